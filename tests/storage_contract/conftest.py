"""The storage contract's fixtures: every test runs once per backend of the table
(`ksi_common.storage_backends`), against a fresh var dir and, for a backend that needs one, a fresh
database. A third backend added to the table runs the whole suite with no change here, once the
`backend_url` fixture below can give it a URL."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from ksi_common.records import IndexEntry
from ksi_common.settings import Settings
from ksi_common.storage_backends import STORAGE_NAMES, Backend, backend_named
from ksi_daemon.storage.backends import build_storage
from ksi_daemon.storage.ports import Storage
from tests.conftest import make_settings

Opener = Callable[[], AbstractAsyncContextManager[Storage]]


@pytest.fixture(params=STORAGE_NAMES)
def contract_backend(request: pytest.FixtureRequest) -> Backend:
    return backend_named(request.param)


@pytest.fixture
def backend_url(contract_backend: Backend, request: pytest.FixtureRequest) -> str | None:
    """The database of a backend that needs a URL: a fresh one of the session's PostgreSQL cluster."""
    return request.getfixturevalue("pg_url") if contract_backend.needs_url else None


@pytest.fixture
def storage_settings(contract_backend: Backend, backend_url: str | None, short_tmp: Path) -> Settings:
    overrides: dict[str, Any] = {"storage": contract_backend.name, "fsync": "never"}
    if backend_url is not None:
        overrides["database_url"] = backend_url
    return make_settings(short_tmp, **overrides)


@pytest.fixture
def open_storage(storage_settings: Settings) -> Opener:
    """Another storage on the same place: a restart, or a second daemon sharing the backend."""

    @asynccontextmanager
    async def opened() -> AsyncIterator[Storage]:
        storage = build_storage(storage_settings)
        await storage.open()
        try:
            yield storage
        finally:
            await storage.close()

    return opened


@pytest.fixture
async def storage(open_storage: Opener) -> AsyncIterator[Storage]:
    async with open_storage() as opened:
        yield opened


def entry(n: int, tokens: int = 10, feedback: bool = False, digest: str | None = None) -> IndexEntry:
    return IndexEntry(n=n, response_id=f"r-{n:04d}-{random.getrandbits(32):08x}", ts="2026-01-01T00:00:00Z",
                      model="m", tokens_in=tokens // 2, tokens_out=tokens - tokens // 2, is_feedback=feedback,
                      digest=digest)


def response_lines(e: IndexEntry, conversation_id: str) -> list[dict[str, Any]]:
    return [{"v": 1, "type": "user", "content": f"q{e.n}", "conversation_id": conversation_id},
            {"v": 1, "type": "assistant", "content": f"a{e.n}", "conversation_id": conversation_id}]
