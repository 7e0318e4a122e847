"""The pool of daemons sharing one database: each registers itself with a heartbeat, every one of
them lists all (through `system:health`, `system:cluster` and `ksi cluster`), a killed one turns
stale by the database's clock, a stopped one leaves, a lost database does not stop the heartbeat's
daemon, and a daemon whose row went away registers again."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pexpect
import pytest

from ksi_common.client import KsiClient
from ksi_common.console_login import make_code
from ksi_common.errors import KsiError
from ksi_common.settings import load_settings
from tests.conftest import connected, running_daemon, running_http_daemon, stub_settings
from tests.pg_cluster import ThrowawayCluster
from tests.test_crash import REPO, DaemonProcess, daemon_env

# short, with room for a daemon starved of CPU on a busy machine to still beat in time
FAST = {"KSI_HEARTBEAT_INTERVAL": "0.25", "KSI_HEARTBEAT_TIMEOUT": "2", "KSI_LITELLM_PRELOAD": "false"}


async def cluster_of(socket: Path) -> dict[str, Any]:
    async with KsiClient(socket) as client:
        return dict((await client.request("system:health"))["cluster"])


async def until(socket: Path, holds: Callable[[dict[str, Any]], bool], tries: int = 300) -> dict[str, Any]:
    """The daemon's pool list once `holds` is true of it (polled, at most about 30 s)."""
    for _ in range(tries):
        pool = await cluster_of(socket)
        if holds(pool):
            return pool
        await asyncio.sleep(0.1)
    raise AssertionError(f"the pool never became as expected: {pool}")


def states(pool: dict[str, Any]) -> dict[int, str]:
    return {d["pid"]: d["state"] for d in pool["daemons"]}


def ksi_cluster(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ksi_cli", "cluster", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})


def ksi_cluster_on_a_terminal(socket: Path) -> list[str]:
    """`ksi cluster` on a pty (a table); its rows, one per daemon."""
    child = pexpect.spawn(sys.executable, ["-m", "ksi_cli", "cluster", "--socket", str(socket)], cwd=str(REPO),
                          env={**os.environ, "PYTHONPATH": str(REPO), "NO_COLOR": "1", "COLUMNS": "200"},
                          encoding="utf-8", timeout=60, dimensions=(50, 200))
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, child.before
    return [line for line in str(child.before).splitlines() if " s ago" in line]


async def test_three_daemons_list_each_other_a_killed_one_turns_stale_a_stopped_one_leaves(
        short_tmp: Path, pg_url: str) -> None:
    env = daemon_env("http://127.0.0.1:1/v1", KSI_STORAGE="postgres", KSI_DATABASE_URL=pg_url, **FAST)
    processes = [DaemonProcess(short_tmp / name, env) for name in ("a", "b", "c")]
    for process in processes:
        process.root.mkdir()
    try:
        await asyncio.gather(*(p.start(litellm=False) for p in processes))
        a, b, c = processes
        pids = {p.process.pid: p for p in processes if p.process is not None}
        for process in processes:
            pool = await until(process.socket, lambda pool: states(pool) == dict.fromkeys(pids, "alive"))
            this = [d for d in pool["daemons"] if d["this"]]
            assert len(this) == 1 and this[0]["pid"] == process.process.pid and this[0]["daemon_id"] == pool["this"]
            assert pool["shared"] is True and pool["error"] is None
            assert len({d["daemon_id"] for d in pool["daemons"]}) == 3
            assert all(d["in_flight"] == d["queued"] == 0 for d in pool["daemons"])

        # the real CLI, piped: JSON; and its exit code when no daemon answers
        listed = await asyncio.to_thread(ksi_cluster, "--socket", str(a.socket))
        assert listed.returncode == 0, listed.stderr
        assert {d["pid"] for d in json.loads(listed.stdout)["daemons"]} == set(pids)
        missing = await asyncio.to_thread(ksi_cluster, "--socket", str(short_tmp / "nobody.sock"))
        assert missing.returncode == 3 and "daemon_unreachable" in missing.stderr

        # a row stale for hours (a daemon long gone) is pruned by the living ones
        conn = await asyncpg.connect(pg_url)
        try:
            await conn.execute("INSERT INTO ksi_daemons VALUES ('gone', 'elsewhere', 1, '0', now() - interval '3 hours', "
                               "now() - interval '2 hours', 0, 0)")
            for _ in range(300):
                if not await conn.fetchval("SELECT count(*) FROM ksi_daemons WHERE daemon_id = 'gone'"):
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("the long-stale row was never pruned")

            assert c.process is not None
            killed = c.process.pid
            c.kill()  # SIGKILL: no chance to leave; its heartbeat just stops
            expected = {a.process.pid: "alive", b.process.pid: "alive", killed: "stale"}
            for process in (a, b):
                pool = await until(process.socket, lambda pool: states(pool) == expected)
                assert next(d for d in pool["daemons"] if d["pid"] == killed)["heartbeat_age"] > 2
            stale = await conn.fetchval("SELECT count(*) FROM ksi_daemons WHERE pid = $1", killed)
            assert stale == 1  # stale, not yet long enough to be pruned
            table = await asyncio.to_thread(ksi_cluster_on_a_terminal, a.socket)
            assert len(table) == 3
            assert any(str(a.process.pid) in row and "(this)" in row for row in table)
            assert any(str(killed) in row and "stale" in row for row in table)

            stopped = b.process.pid
            await b.stop()  # a clean stop removes its row
            assert await conn.fetchval("SELECT count(*) FROM ksi_daemons WHERE pid = $1", stopped) == 0
            await until(a.socket, lambda pool: states(pool) == {a.process.pid: "alive", killed: "stale"})
        finally:
            await conn.close()
    finally:
        for process in processes:
            if process.process is not None and process.process.poll() is None:
                await process.stop()


async def test_a_daemon_keeps_answering_without_its_database_and_registers_again(
        short_tmp: Path, pg_url: str, pg_cluster: ThrowawayCluster) -> None:
    settings = {"storage": "postgres", "database_url": pg_url, "heartbeat_interval": 0.2, "heartbeat_timeout": 1.0}
    async with running_http_daemon(short_tmp, **settings) as served, connected(served.daemon) as client, \
            httpx.AsyncClient(base_url=served.base_url, timeout=10.0) as http:
        daemon = served.daemon
        login = await http.get("/login", params={"code": make_code(served.token)})
        assert login.status_code == 303
        health_page = login.headers["location"].rstrip("/") + "/health?fragment=1"
        me = daemon.pool.me.daemon_id
        assert (await client.request("system:health"))["storage"]["daemon_id"] == me  # one id, relay and pool
        before = (await client.request("system:cluster"))["daemons"]
        assert [(d["daemon_id"], d["pid"], d["state"], d["this"]) for d in before] == [(me, os.getpid(), "alive", True)]

        await asyncio.to_thread(pg_cluster.stop)
        try:
            # health still answers, from the last list, and says the heartbeat fails
            pool = await until(daemon.settings.socket, lambda pool: pool["error"] is not None)
            assert "database" in pool["error"] and [d["daemon_id"] for d in pool["daemons"]] == [me]
            pool = await until(daemon.settings.socket, lambda pool: pool["daemons"][0]["state"] == "stale")
            # the console's health page marks it
            shown = (await http.get(health_page)).text
            assert f'data-daemon="{me}" data-state="stale"' in shown and "data-heartbeat-error" in shown
        finally:
            await asyncio.to_thread(pg_cluster.start)
        pool = await until(daemon.settings.socket,
                           lambda pool: pool["error"] is None and pool["daemons"][0]["state"] == "alive")
        shown = (await http.get(health_page)).text
        assert f'data-daemon="{me}" data-state="alive"' in shown and "data-heartbeat-error" not in shown

        # its row removed behind its back (pruned while it was paused): the next heartbeat registers it again
        conn = await asyncpg.connect(pg_url)
        try:
            deleted_at = await conn.fetchval("SELECT now()")
            assert await conn.execute("DELETE FROM ksi_daemons WHERE daemon_id = $1", me) == "DELETE 1"
            for _ in range(300):
                again = await conn.fetchrow("SELECT started, pid FROM ksi_daemons WHERE daemon_id = $1", me)
                if again is not None:
                    break
                await asyncio.sleep(0.1)
            assert again is not None and again["pid"] == os.getpid()
            assert again["started"] < deleted_at  # when it started, not when it registered again
        finally:
            await conn.close()


async def test_with_jsonl_storage_the_pool_is_this_daemon_alone_with_its_load(short_tmp: Path, stub: Any) -> None:
    async with running_daemon(short_tmp, **stub_settings(stub), heartbeat_interval=0.1) as daemon, \
            connected(daemon) as client:
        pool = (await client.request("system:health"))["cluster"]
        assert pool["shared"] is False and pool["error"] is None
        assert [(d["pid"], d["state"], d["this"]) for d in pool["daemons"]] == [(os.getpid(), "alive", True)]
        assert (await client.request("system:cluster"))["daemons"][0]["daemon_id"] == pool["this"]
        # the heartbeat carries the load: one request held by the model, one queued behind it
        stub.hold = 1.0
        acks = [await client.request("completion:async", {"prompt": f"p{i}", "conversation_id": "held",
                                                          "create": i == 0}) for i in range(2)]
        pool = await until(daemon.settings.socket, lambda pool: pool["daemons"][0]["in_flight"] == 1)
        assert pool["daemons"][0]["queued"] == 1
        stub.hold = 0.0
        for ack in acks:
            await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 30})
        await until(daemon.settings.socket, lambda pool: (pool["daemons"][0]["in_flight"],
                                                          pool["daemons"][0]["queued"]) == (0, 0))
    with pytest.raises(KsiError):  # stopped: the socket is gone
        await cluster_of(daemon.settings.socket)


@pytest.mark.parametrize(("values", "variable"), [
    ({"KSI_HEARTBEAT_INTERVAL": "0"}, "KSI_HEARTBEAT_INTERVAL"),
    ({"KSI_HEARTBEAT_INTERVAL": "2", "KSI_HEARTBEAT_TIMEOUT": "2"}, "KSI_HEARTBEAT_TIMEOUT"),
    ({"KSI_HEARTBEAT_TIMEOUT": "1"}, "KSI_HEARTBEAT_TIMEOUT"),  # below the default interval (2 s)
])
def test_a_heartbeat_timeout_not_above_the_interval_is_a_settings_error(
        values: dict[str, str], variable: str, short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(KsiError) as refused:
        load_settings(_env_file=None)
    assert refused.value.code == "validation_error" and variable in refused.value.details["fields"]
    # the daemon refuses to start on it, naming the variable, and creates nothing
    done = subprocess.run([sys.executable, "-m", "ksi_daemon", "--var-dir", str(short_tmp / "var"),
                           "--socket", str(short_tmp / "d.sock")], cwd=short_tmp, capture_output=True, text=True,
                          timeout=60, env={**daemon_env("http://127.0.0.1:1/v1"), **values})
    assert done.returncode == 2 and variable in done.stderr
    assert not (short_tmp / "var").exists() and not (short_tmp / "d.sock").exists()
