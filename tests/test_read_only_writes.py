"""A var dir made read-only while the daemon runs (read-only bind mounts, which root respects too):
a client-held history that must be imported and conversation items added over HTTP fail with
503 `storage_error`, like every other write, never 500 `internal_error`; nothing is left behind
and the daemon writes again once the var dir is writable. JSONL only: on PostgreSQL these writes
go to the database, not the var dir."""

from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from ksi_common.layout import VarLayout
from tests.conftest import HttpDaemon, running_http_daemon


@contextmanager
def read_only(*directories: Path) -> Iterator[None]:
    for directory in directories:
        subprocess.run(["mount", "--bind", str(directory), str(directory)], check=True)
        subprocess.run(["mount", "-o", "remount,bind,ro", str(directory)], check=True)
    try:
        yield
    finally:
        for directory in directories:
            subprocess.run(["umount", str(directory)], check=True)


def frozen(layout: VarLayout) -> tuple[Path, ...]:
    """Where new conversations, their indexes and their responses go."""
    return (layout.responses_dir, layout.conversation_meta_dir, layout.index_file("x").parent)


@pytest.fixture
async def http(short_tmp: Path) -> AsyncIterator[HttpDaemon]:
    async with running_http_daemon(short_tmp, default_model="echo/x") as running:
        yield running


@pytest.fixture
async def api(http: HttpDaemon) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=f"{http.base_url}/v1", timeout=30,
                                 headers={"Authorization": f"Bearer {http.token}"}) as client:
        yield client


def listed(layout: VarLayout) -> list[str]:
    return sorted(p.name for p in layout.conversation_meta_dir.iterdir())


HISTORY: list[dict[str, Any]] = [{"role": "user", "content": "earlier"}, {"role": "assistant", "content": "reply"},
                                 {"role": "user", "content": "now"}]


async def test_a_history_import_on_a_read_only_var_dir_is_a_storage_error(
        http: HttpDaemon, api: httpx.AsyncClient) -> None:
    layout = http.daemon.layout
    first = await api.post("/responses", json={"model": "echo/x", "input": "opening"})
    assert first.status_code == 200, first.text
    before = listed(layout)
    with read_only(*frozen(layout)):
        refused = await api.post("/responses", json={"model": "echo/x", "input": HISTORY})
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "storage_error"
        chat = await api.post("/chat/completions", json={"model": "echo/x", "messages": HISTORY})
        assert chat.status_code == 503, chat.text
        assert chat.json()["error"]["code"] == "storage_error"
    assert listed(layout) == before
    again = await api.post("/responses", json={"model": "echo/x", "input": HISTORY})
    assert again.status_code == 200, again.text


async def test_conversation_items_on_a_read_only_var_dir_are_a_storage_error(
        http: HttpDaemon, api: httpx.AsyncClient) -> None:
    layout = http.daemon.layout
    made = await api.post("/conversations", json={"items": [{"type": "message", "role": "user", "content": "hi"}]})
    assert made.status_code == 200, made.text
    conversation_id = made.json()["id"]
    items = [{"type": "message", "role": "user", "content": "more"},
             {"type": "message", "role": "assistant", "content": "an answer"}]
    before = (await api.get(f"/conversations/{conversation_id}/items")).json()["data"]
    with read_only(*frozen(layout)):
        added = await api.post(f"/conversations/{conversation_id}/items", json={"items": items})
        assert added.status_code == 503, added.text
        assert added.json()["error"]["code"] == "storage_error"
        new = await api.post("/conversations", json={"items": items})
        assert new.status_code == 503, new.text
        assert new.json()["error"]["code"] == "storage_error"
    assert (await api.get(f"/conversations/{conversation_id}/items")).json()["data"] == before
    added = await api.post(f"/conversations/{conversation_id}/items", json={"items": items})
    assert added.status_code == 200, added.text
