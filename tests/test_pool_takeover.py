"""Accepted means durable for the pool: a daemon killed with SIGKILL leaves its running and queued
turns and its consortium run to the others, which finish them under the same ids while a client
waits on a third daemon; a request whose exchange was stored before its daemon died is reported
done from storage, never run again; status and cancel answer from any daemon."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from ksi_common.client import KsiClient
from ksi_common.errors import ErrorCode, KsiError
from tests.conftest import complete, connected, running_daemon, stub_settings
from tests.test_pool_order import ARBITER_ASKS, daemon_processes, members_and_judge, stored, user_turns

FAST = {"heartbeat_interval": 0.25, "heartbeat_timeout": 5.0, "pool_lease": 2.0}


async def loaded(*daemons: Any) -> None:
    """litellm imported before the test's turns: its import holds the interpreter for seconds, and
    daemons in this process whose heartbeats it delays past the timeout would look dead."""
    for daemon in daemons:
        await daemon.litellm.ensure_loaded()
    await asyncio.sleep(1.0)  # fresh heartbeats from both


def calls_for(stub: Any, prompt: str) -> list[dict[str, Any]]:
    return [r for r in stub.requests if user_turns(r["messages"])[-1:] == [prompt]
            and not any(ARBITER_ASKS in str(m.get("content")) for m in r["messages"])]


async def test_a_killed_daemons_running_queued_and_consortium_requests_are_finished_by_the_others(
        short_tmp: Path, pg_url: str, stub: Any) -> None:
    stub.answer = members_and_judge
    stub.model_delay["stub-slow"] = 3.0  # killed while these calls are at the model
    async with daemon_processes(short_tmp, pg_url, stub, KSI_HEARTBEAT_TIMEOUT="2", KSI_POOL_LEASE="2") as (a, b, c):
        async with KsiClient(b.socket) as on_b:
            await on_b.request("consortium:save", {"name": "slowduo", "members": ["openai/stub-slow", "openai/stub-ma"],
                                                   "arbiter": "openai/stub-judge"})
        async with KsiClient(a.socket) as on_a:
            await complete(on_a, prompt="opening", conversation_id="x", create=True)
            acks = [
                await on_a.request("completion:async", {"prompt": "slow on a", "conversation_id": "x",
                                                        "model": "openai/stub-slow"}),
                await on_a.request("completion:async", {"prompt": "queued on a", "conversation_id": "x"}),
                await on_a.request("completion:async", {"prompt": "asked the duo", "conversation_id": "y",
                                                        "create": True, "model": "consortium/slowduo"}),
            ]
            while len([r for r in stub.requests if r["model"] == "stub-slow"]) < 2:
                await asyncio.sleep(0.02)  # the slow turn and the consortium's slow member are at the model
            assert a.process is not None
            a.kill()
        async with KsiClient(c.socket) as on_c:  # a client that never spoke to the dead daemon
            status = await on_c.request("completion:status", {"request_id": acks[1]["request_id"]})
            assert status["status"] == "queued" and status["conversation_id"] == "x"
            results = [await on_c.request("completion:wait", {"request_id": ack["request_id"], "timeout": 60})
                       for ack in acks]
        x = await stored(b.var, pg_url, "x")
        y = await stored(b.var, pg_url, "y")

    # each request finished once, under the ids its ack gave, by one of the daemons still alive
    assert [r["response_id"] for r in results] == [ack["response_id"] for ack in acks]
    assert [p for _n, _r, p in x] == ["opening", "slow on a", "queued on a"]
    assert [r for _n, r, _p in x][1:] == [acks[0]["response_id"], acks[1]["response_id"]]
    assert [(p, r) for _n, r, p in y] == [("asked the duo", acks[2]["response_id"])]
    assert results[2]["content"] == "the consensus"
    # the queued turn was run once, after the slow one, and was shown it
    [queued_call] = calls_for(stub, "queued on a")
    assert user_turns(queued_call["messages"]) == ["opening", "slow on a", "queued on a"]
    # the killed daemon's calls never completed: each of its requests was answered by one more call
    assert len(calls_for(stub, "slow on a")) == 2


async def test_a_request_stored_before_its_daemon_died_is_reported_done_not_run_again(
        short_tmp: Path, pg_url: str, stub: Any) -> None:
    settings = {**stub_settings(stub), "storage": "postgres", "database_url": pg_url, **FAST}
    (short_tmp / "b").mkdir()
    (short_tmp / "c").mkdir()
    async with running_daemon(short_tmp / "b", **settings) as b, running_daemon(short_tmp / "c", **settings) as c, \
            connected(b) as on_b, connected(c) as on_c:
        await loaded(b, c)
        done = await complete(on_b, prompt="stored", conversation_id="s", create=True)
        await b.storage.requests.flush()
        # as a daemon killed after its exchange was stored and before its end was: still open, its own
        connection = await asyncpg.connect(pg_url)
        try:
            await connection.execute("UPDATE ksi_requests SET daemon_id = 'gone-daemon', status = 'queued', "
                                     "finished = NULL WHERE request_id = $1", done["request_id"])
        finally:
            await connection.close()
        calls = len(stub.requests)
        result = await on_c.request("completion:wait", {"request_id": done["request_id"], "timeout": 30})
        assert (result["response_id"], result["content"]) == (done["response_id"], done["content"])
        connection = await asyncpg.connect(pg_url)
        try:
            for _ in range(100):  # until the daemon that took it over recorded it done
                row = await connection.fetchrow("SELECT daemon_id, taken_from, status, finished FROM ksi_requests "
                                                "WHERE request_id = $1", done["request_id"])
                if row["finished"] is not None:
                    break
                await asyncio.sleep(0.1)
        finally:
            await connection.close()
        assert (row["status"], row["taken_from"]) == ("done", "gone-daemon"), dict(row)
        assert row["daemon_id"] in (b.storage.daemon_id, c.storage.daemon_id)
        assert len(stub.requests) == calls  # not run again
        assert [p for _n, _r, p in await stored(b.settings.var_dir, pg_url, "s")] == ["stored"]


async def test_status_wait_and_cancel_of_another_daemons_request(short_tmp: Path, pg_url: str, stub: Any) -> None:
    settings = {**stub_settings(stub), "storage": "postgres", "database_url": pg_url, **FAST}
    stub.model_delay["stub-slow"] = 30.0
    (short_tmp / "b").mkdir()
    (short_tmp / "c").mkdir()
    async with running_daemon(short_tmp / "b", **settings) as b, running_daemon(short_tmp / "c", **settings) as c, \
            connected(b) as on_b, connected(c) as on_c:
        await loaded(b, c)
        slow = await on_b.request("completion:async", {"prompt": "long", "conversation_id": "k", "create": True,
                                                       "model": "openai/stub-slow"})
        behind = await on_b.request("completion:async", {"prompt": "behind", "conversation_id": "k"})
        waited = await on_c.request("completion:wait", {"request_id": behind["request_id"], "timeout": 0.2})
        assert waited["status"] == "queued"
        cancelled = await on_c.request("completion:cancel", {"request_id": slow["request_id"]})
        assert cancelled["cancelled"] is True and cancelled["status"] == "cancelled"
        with pytest.raises(KsiError) as refused:
            await on_c.request("completion:wait", {"request_id": slow["request_id"], "timeout": 5})
        assert refused.value.code == "cancelled"
        result = await on_c.request("completion:wait", {"request_id": behind["request_id"], "timeout": 30})
        assert result["content"] == "stub answer to: behind"
        with pytest.raises(KsiError) as unknown:
            await on_c.request("completion:status", {"request_id": "req-nobody"})
        assert unknown.value.code == "request_not_found"
        assert [p for _n, _r, p in await stored(c.settings.var_dir, pg_url, "k")] == ["behind"]


async def test_a_daemon_paused_past_the_heartbeat_timeout_wakes_to_find_its_turn_finished_by_another(
        short_tmp: Path, pg_url: str, stub: Any) -> None:
    stub.model_delay["stub-slow"] = 4.0
    async with daemon_processes(short_tmp, pg_url, stub, names="ab", KSI_HEARTBEAT_TIMEOUT="2",
                                KSI_POOL_LEASE="2") as (a, b), KsiClient(a.socket) as on_a:
        slow = await on_a.request("completion:async", {"prompt": "slow on a", "conversation_id": "p", "create": True,
                                                       "model": "openai/stub-slow"})
        queued = await on_a.request("completion:async", {"prompt": "queued on a", "conversation_id": "p",
                                                         "background": True})
        while not calls_for(stub, "slow on a"):
            await asyncio.sleep(0.02)
        assert a.process is not None
        os.kill(a.process.pid, signal.SIGSTOP)
        try:
            async with KsiClient(b.socket) as on_b:  # B takes them over and answers them
                done = await on_b.request("completion:wait", {"request_id": slow["request_id"], "timeout": 60})
                after = await on_b.request("completion:wait", {"request_id": queued["request_id"], "timeout": 60})
        finally:
            os.kill(a.process.pid, signal.SIGCONT)
        # A wakes with its own call answered: it stores nothing, and its client gets B's result
        on_a_result = await on_a.request("completion:wait", {"request_id": slow["request_id"], "timeout": 60})
        assert on_a_result["response_id"] == done["response_id"] == slow["response_id"]
        assert on_a_result["content"] == done["content"]
        # the queued one went to B whole: A's background stream of it does not stay "queued" for good;
        # A reads the pool, where it is done and stored, and sends its reader to the stored response
        with pytest.raises(KsiError) as moved:
            await on_a.request("completion:chunks", {"response_id": queued["response_id"], "wait": 5})
        assert moved.value.code == ErrorCode.RESPONSE_NOT_FOUND
        shown = await on_a.request("response:show", {"response_id": queued["response_id"]})
        assert after["content"] in json.dumps(shown)
        exchanges = await stored(b.var, pg_url, "p")
    assert [(p, r) for _n, r, p in exchanges] == [("slow on a", slow["response_id"]),
                                                 ("queued on a", queued["response_id"])]
