"""Fixtures: a real daemon on a temporary var dir and a short socket path, clean env."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ksi_common.client import KsiClient
from ksi_common.settings import Settings
from ksi_common.storage_backends import DEFAULT_STORAGE, STORAGE_NAMES, backend_named
from ksi_daemon.daemon import Daemon
from tests.browser import chromium
from tests.pg_cluster import ThrowawayCluster

PROVIDER_PREFIXES = ("OPENAI_", "ANTHROPIC_", "GEMINI_", "GOOGLE_", "AZURE_", "OLLAMA_", "LITELLM_", "KSI_")


@pytest.fixture(autouse=True)
def clean_provider_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test sees a real key or base URL; the openai client still needs some key."""
    for name in list(os.environ):
        if name.startswith(PROVIDER_PREFIXES):
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-dummy")
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    monkeypatch.setenv("LITELLM_MODE", "PRODUCTION")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "backends: run the module's daemon tests against every storage backend")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Tests of modules marked `backends` run once per storage backend: the same specification."""
    if "backend" in metafunc.fixturenames and metafunc.definition.get_closest_marker("backends"):
        metafunc.parametrize("backend", STORAGE_NAMES, indirect=True)


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Settings overrides that choose the storage backend (JSONL unless the module is marked)."""
    name = getattr(request, "param", DEFAULT_STORAGE)
    if name == DEFAULT_STORAGE:
        return {}
    if backend_named(name).needs_url:
        return {"storage": name, "database_url": request.getfixturevalue("pg_url")}
    return {"storage": name}


@pytest.fixture(scope="session")
def pg_cluster() -> Any:
    """A throwaway PostgreSQL cluster for the whole session, removed at its end."""
    cluster = ThrowawayCluster()
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.remove()


@pytest.fixture
def pg_url(pg_cluster: ThrowawayCluster) -> Any:
    """The URL of a fresh, empty database of the session's cluster (with its password in it)."""
    name = pg_cluster.create_database()
    yield pg_cluster.url(name)
    pg_cluster.drop_database(name)


@pytest.fixture(autouse=True)
def private_state_home(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A command that finds no var dir falls back to the per-user one: never the real user's (nor
    the real user's configuration file)."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state-home")))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("config-home")))


@pytest.fixture
def short_tmp() -> Any:
    """A short temporary directory: Unix socket paths must stay under 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="ksi-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def make_settings(root: Path, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "var_dir": root / "var",
        "socket_path": root / "d.sock",
        "litellm_preload": False,
        "retry_base_delay": 0.01,
        "retry_max_delay": 0.05,
    }
    values.update(overrides)
    return Settings(_env_file=None, **values)


@asynccontextmanager
async def running_daemon(root: Path, **overrides: Any) -> AsyncIterator[Daemon]:
    """A real daemon, in this process, on `root`; shut down gracefully on exit."""
    daemon = Daemon(make_settings(root, **overrides))
    await daemon.start()
    try:
        yield daemon
    finally:
        await daemon.shutdown()


@asynccontextmanager
async def connected(daemon: Daemon) -> AsyncIterator[KsiClient]:
    async with KsiClient(daemon.settings.socket) as client:
        yield client


@pytest.fixture
async def daemon(short_tmp: Path, backend: dict[str, Any]) -> AsyncIterator[Daemon]:
    async with running_daemon(short_tmp, **backend) as running:
        yield running


@pytest.fixture
async def client(daemon: Daemon) -> AsyncIterator[KsiClient]:
    async with connected(daemon) as connection:
        yield connection


@pytest.fixture
async def stub() -> AsyncIterator[Any]:
    """A local OpenAI-compatible server; models `openai/stub-*` point at it (see stub_settings)."""
    from tests.stub_openai import StubOpenAI

    async with StubOpenAI() as server:
        yield server


def stub_settings(server: Any, **overrides: Any) -> dict[str, Any]:
    """Settings overrides that route `openai/stub*` models to `server`."""
    models = {"openai/stub*": {"api_base": server.api_base}}
    models.update(overrides.pop("models", {}))
    return {"models": models, "default_model": "openai/stub-model", **overrides}


@pytest.fixture
async def stub_daemon(short_tmp: Path, stub: Any, backend: dict[str, Any]) -> AsyncIterator[Daemon]:
    async with running_daemon(short_tmp, **stub_settings(stub), **backend) as running:
        yield running


async def complete(client: KsiClient, timeout: float = 30.0, **data: Any) -> dict[str, Any]:
    """completion:async then completion:wait; returns the result data (raises KsiError on failure)."""
    ack = await client.request("completion:async", data)
    return await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": timeout})


HTTP_TOKEN = "ksi-test-token-0123456789"


@dataclass(frozen=True)
class HttpDaemon:
    """A daemon serving HTTP on a free loopback port: `base_url` (no trailing slash) and its `token`."""

    daemon: Daemon
    base_url: str
    token: str


@asynccontextmanager
async def running_http_daemon(root: Path, **overrides: Any) -> AsyncIterator[HttpDaemon]:
    """A real in-process daemon whose HTTP front listens on 127.0.0.1, port chosen by the kernel."""
    overrides.setdefault("http_addr", "127.0.0.1:0")
    overrides.setdefault("http_token", HTTP_TOKEN)
    async with running_daemon(root, **overrides) as running:
        yield HttpDaemon(running, running.http.url, running.http.token)


@pytest.fixture
async def http_daemon(short_tmp: Path, stub: Any) -> AsyncIterator[HttpDaemon]:
    """HTTP on a free port, `openai/stub*` models routed to the local stub (the default model)."""
    async with running_http_daemon(short_tmp, **stub_settings(stub)) as running:
        yield running


@pytest.fixture
async def http(short_tmp: Path, stub: Any, backend: dict[str, Any]) -> AsyncIterator[HttpDaemon]:
    """HTTP on a free port over the stub, on each storage backend (a module may give its own)."""
    async with running_http_daemon(short_tmp, **stub_settings(stub), **backend) as running:
        yield running


@pytest.fixture
async def api(http: HttpDaemon) -> AsyncIterator[Any]:
    """The official `openai` SDK's async client on `http`, as a user makes one (no retries)."""
    import openai  # only the modules that use the SDK load it

    async with openai.AsyncOpenAI(base_url=f"{http.base_url}/v1", api_key=http.token, max_retries=0) as client:
        yield client


@pytest.fixture(scope="session")
def chromium_path() -> str:
    """The distribution's Chromium, installed by the session when missing (see tests/browser.py)."""
    return chromium()
