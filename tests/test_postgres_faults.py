"""Faults of the database under a PostgreSQL daemon: unreachable at start (a clear error, exit code
4, nothing half-created), going away mid-run (storage_unavailable replies, the daemon keeps serving
what needs no database, and recovers when it is back), a schema newer than the daemon (refused)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from ksi_common.errors import KsiError
from ksi_daemon.daemon import Daemon
from ksi_daemon.storage.postgres.schema import SCHEMA_VERSION
from tests.conftest import complete, connected, make_settings, running_daemon, stub_settings
from tests.pg_cluster import PASSWORD, ThrowawayCluster
from tests.test_crash import REPO, daemon_env

UNREACHABLE = f"postgresql://ksi:{PASSWORD}@127.0.0.1:1/nowhere"


def run_daemon_process(root: Path, url: str) -> subprocess.CompletedProcess[str]:
    env = daemon_env("http://127.0.0.1:1/v1", KSI_STORAGE="postgres", KSI_DATABASE_URL=url)
    return subprocess.run([sys.executable, "-m", "ksi_daemon", "--var-dir", str(root / "var"),
                           "--socket", str(root / "d.sock")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


def test_an_unreachable_database_stops_the_daemon_at_start_with_a_clear_error(short_tmp: Path) -> None:
    done = run_daemon_process(short_tmp, UNREACHABLE)
    assert done.returncode == 4
    assert "ksi-daemon: storage: cannot connect to the database at postgresql://ksi:***@127.0.0.1:1/nowhere" \
        in done.stderr
    assert PASSWORD not in done.stderr + done.stdout
    assert "Traceback" not in done.stderr
    # nothing that says a daemon runs here: no socket, no pid file, the lock free for the next one
    assert not (short_tmp / "d.sock").exists()
    assert not (short_tmp / "var" / "run" / "daemon.pid").exists()
    log = (short_tmp / "var" / "logs" / "daemon" / "daemon.log")
    assert not log.exists() or PASSWORD not in log.read_text()


async def test_an_unreachable_database_fails_start_in_process_and_leaves_the_var_dir_free(short_tmp: Path) -> None:
    daemon = Daemon(make_settings(short_tmp, storage="postgres", database_url=UNREACHABLE))
    with pytest.raises(KsiError) as refused:
        await daemon.start()
    assert refused.value.code == "storage_unavailable" and PASSWORD not in refused.value.message
    assert not daemon.settings.socket.exists() and not daemon.layout.pid_file.exists()
    async with running_daemon(short_tmp) as again:  # the lock was let go: a JSONL daemon starts here
        assert again.layout.pid_file.exists()


async def test_a_schema_newer_than_the_daemon_is_refused(short_tmp: Path, pg_url: str) -> None:
    async with running_daemon(short_tmp, storage="postgres", database_url=pg_url):
        pass
    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute("INSERT INTO ksi_schema (version, description) VALUES ($1, 'from a newer KSI')",
                           SCHEMA_VERSION + 1)
    finally:
        await conn.close()
    done = await asyncio.to_thread(run_daemon_process, short_tmp, pg_url)
    assert done.returncode == 4
    assert f"schema is at version {SCHEMA_VERSION + 1}, newer than this KSI knows ({SCHEMA_VERSION})" in done.stderr
    assert PASSWORD not in done.stderr


async def test_the_database_going_away_mid_run_then_coming_back(short_tmp: Path, pg_url: str,
                                                                pg_cluster: ThrowawayCluster, stub: Any) -> None:
    settings = {**stub_settings(stub), "storage": "postgres", "database_url": pg_url}
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        first = await complete(client, prompt="before", conversation_id="c", create=True)
        assert first["exchange"] == 1
        # a request whose model answers while the database is away waits for it to come back: the
        # answer is stored then, once, in its place
        stub.hold = 1.0
        ack = await client.request("completion:async", {"prompt": "during", "conversation_id": "c"})
        await asyncio.sleep(0.2)
        await asyncio.to_thread(pg_cluster.stop)
        try:
            waiting = await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 3})
            assert waiting["status"] == "running"
            stub.hold = 0.0
            for event, data in (("completion:async", {"prompt": "down", "conversation_id": "c"}),
                                ("completion:async", {"prompt": "new", "conversation_id": "n", "create": True}),
                                ("conversation:list", {}),
                                ("conversation:show", {"conversation_id": "c"})):
                with pytest.raises(KsiError) as refused:
                    await client.request(event, data)
                assert refused.value.code == "storage_unavailable", event
                assert PASSWORD not in str(refused.value.details)
            health = await client.request("system:health")  # what needs no database goes on
            assert health["storage"]["backend"] == "postgres" and PASSWORD not in str(health)
        finally:
            await asyncio.to_thread(pg_cluster.start)
        during = await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 90})
        assert during["exchange"] == 2
        again = await complete(client, prompt="after", conversation_id="c")
        assert again["exchange"] == 3
        assert [m["content"] for m in stub.messages()][-3:] == ["during", "stub answer to: during", "after"]
        entries = await daemon.storage.conversations.entries("c")
        assert [e.response_id for e in entries] == [first["response_id"], during["response_id"],
                                                    again["response_id"]]
        created = await complete(client, prompt="new", conversation_id="n", create=True)
        assert created["exchange"] == 1
