"""One order per conversation across daemons: three daemon processes on one database run a
conversation's turns one at a time, each answer generated from every exchange stored before it;
a daemon paused past its lease cannot store what another daemon took over; a clean stop gives its
leases back."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import asyncpg

from ksi_common.client import KsiClient
from ksi_common.errors import KsiError
from ksi_common.layout import VarLayout
from ksi_common.reading import open_reader
from tests.conftest import complete, connected, running_daemon, stub_settings
from tests.test_crash import DaemonProcess, daemon_env

POOL = {"KSI_HEARTBEAT_INTERVAL": "0.25", "KSI_HEARTBEAT_TIMEOUT": "3", "KSI_SUMMARISER": "off"}


@asynccontextmanager
async def daemon_processes(root: Path, url: str, stub: Any, names: str = "abc", via: bool = False,
                           **extra: str) -> AsyncIterator[list[DaemonProcess]]:
    """Daemons named by the letters of `names`; `via`: each calls the stub through its own api_base,
    so the stub counts each one's calls apart."""
    processes = [DaemonProcess(root / name, daemon_env(stub.api_base_via(name) if via else stub.api_base,
                                                       KSI_STORAGE="postgres", KSI_DATABASE_URL=url,
                                                       **{**POOL, **extra}))
                 for name in names]
    for process in processes:
        process.root.mkdir()
    try:
        for process in processes:  # one at a time: the first migrates the database
            await process.start(wait=120)
        yield processes
    finally:
        for process in processes:
            if process.process is not None and process.process.poll() is None:
                os.kill(process.process.pid, signal.SIGCONT)
                await process.stop()


async def stored(var: Path, url: str, conversation_id: str) -> list[tuple[int, str, str]]:
    """(n, response id, the exchange's prompt) of every indexed exchange, in order."""
    reader = open_reader("postgres", VarLayout(var), url)
    try:
        entries = await reader.entries(conversation_id)
        records = await reader.responses([e.response_id for e in entries])
        return [(e.n, e.response_id, str(r.inputs[0]["content"]) if r is not None else "")
                for e, r in zip(entries, records, strict=True)]
    finally:
        await reader.aclose()


def user_turns(messages: list[dict[str, Any]]) -> list[str]:
    return [str(m["content"]) for m in messages if m["role"] == "user"]


async def test_concurrent_turns_through_three_daemons_each_see_every_exchange_stored_before(
        short_tmp: Path, pg_url: str, stub: Any) -> None:
    stub.hold = 0.05  # long enough that turns sent at once would overlap without the lease
    clients, turns = 6, 3
    async with daemon_processes(short_tmp, pg_url, stub) as daemons:
        async with KsiClient(daemons[0].socket) as first:
            ack = await first.request("completion:async", {"prompt": "opening", "conversation_id": "busy",
                                                           "create": True})
            await first.request("completion:wait", {"request_id": ack["request_id"], "timeout": 30})

        async def one_client(i: int) -> list[dict[str, Any]]:
            async with KsiClient(daemons[i % 3].socket) as client:
                acks = [await client.request("completion:async", {"prompt": f"c{i} t{t}", "conversation_id": "busy"})
                        for t in range(turns)]
                return [await client.request("completion:wait", {"request_id": a["request_id"], "timeout": 120})
                        for a in acks]

        results = [r for rs in await asyncio.gather(*(one_client(i) for i in range(clients))) for r in rs]
        exchanges = await stored(daemons[0].var, pg_url, "busy")

    assert [n for n, _r, _p in exchanges] == list(range(1, clients * turns + 2))
    assert sorted(r["response_id"] for r in results) == sorted(r for _n, r, _p in exchanges[1:])
    prompts = [p for _n, _r, p in exchanges]
    # one model call per stored exchange, none run twice, and each call was shown exactly the
    # exchanges stored before its own, in their order: no answer from a stale history
    assert len(stub.requests) == len(exchanges)
    for request in stub.requests:
        shown = user_turns(request["messages"])
        n = prompts.index(shown[-1])
        assert shown[:-1] == prompts[:n], (shown[-1], n, shown[:-1])
    for i in range(clients):  # each client's turns were taken in the order they were accepted
        mine = [p for p in prompts if p.startswith(f"c{i} ")]
        assert mine == [f"c{i} t{t}" for t in range(turns)]


async def test_a_daemon_paused_past_its_lease_cannot_store_the_turn_another_daemon_took_over(
        short_tmp: Path, pg_url: str, stub: Any) -> None:
    stub.model_delay["stub-slow"] = 4.0
    # a heartbeat timeout far beyond the pause: the turn is lost to B's lease, not taken over by B
    async with daemon_processes(short_tmp, pg_url, stub, names="ab", KSI_POOL_LEASE="1",
                                KSI_HEARTBEAT_TIMEOUT="60") as (a, b), \
            KsiClient(a.socket) as on_a, KsiClient(b.socket) as on_b:
        opening = await on_b.request("completion:async", {"prompt": "opening", "conversation_id": "c", "create": True})
        await on_b.request("completion:wait", {"request_id": opening["request_id"], "timeout": 30})
        slow = await on_a.request("completion:async", {"prompt": "slow on a", "conversation_id": "c",
                                                       "model": "openai/stub-slow"})
        while len(stub.requests) < 2:  # A holds the lease and its call is at the model
            await asyncio.sleep(0.02)
        assert a.process is not None
        os.kill(a.process.pid, signal.SIGSTOP)
        try:
            after = await on_b.request("completion:async", {"prompt": "after on b", "conversation_id": "c"})
            taken = await on_b.request("completion:wait", {"request_id": after["request_id"], "timeout": 60})
            assert taken["exchange"] == 2
            assert user_turns(stub.messages()) == ["opening", "after on b"]
        finally:
            os.kill(a.process.pid, signal.SIGCONT)
        try:
            await on_a.request("completion:wait", {"request_id": slow["request_id"], "timeout": 60})
            raise AssertionError("the paused daemon stored its answer over the turn another daemon took")
        except KsiError as refused:
            assert refused.code == "lease_lost"
        # the history holds the turn B took and nothing of A's; the next turn, on A, sees it whole
        follow = await on_a.request("completion:async", {"prompt": "next on a", "conversation_id": "c"})
        result = await on_a.request("completion:wait", {"request_id": follow["request_id"], "timeout": 30})
        assert result["exchange"] == 3
        assert user_turns(stub.messages()) == ["opening", "after on b", "next on a"]
        exchanges = await stored(a.var, pg_url, "c")
        assert [p for _n, _r, p in exchanges] == ["opening", "after on b", "next on a"]
        reader = open_reader("postgres", VarLayout(a.var), pg_url)
        try:  # the refused answer is kept as a failure, never as an answer
            [record] = await reader.responses([slow["response_id"]])
        finally:
            await reader.aclose()
        assert record is not None and not record.ok


ARBITER_ASKS = "Reply with ONLY a JSON object"


def members_and_judge(messages: list[dict[str, Any]]) -> str:
    """Members answer the latest input; the arbiter (asked for JSON) gives a confident synthesis."""
    if any(ARBITER_ASKS in str(m.get("content")) for m in messages):
        return json.dumps({"synthesis": "the consensus", "confidence": 0.95, "dissent": "",
                           "refinement_areas": [], "needs_iteration": False, "ranking": [1]})
    return f"stub answer to: {user_turns(messages)[-1]}"


async def test_agent_turns_and_consortium_runs_hold_the_conversation_like_any_turn(
        short_tmp: Path, pg_url: str, stub: Any) -> None:
    stub.answer = members_and_judge
    stub.hold = 0.05
    async with daemon_processes(short_tmp, pg_url, stub) as (a, b, c):
        async with KsiClient(a.socket) as on_a:
            await on_a.request("agent:spawn", {"agent_id": "scribe", "system": "Be brief."})
            await on_a.request("agent:send_message", {"agent_id": "scribe", "message": "opening", "wait": 60})
        async with KsiClient(b.socket) as on_b:
            await on_b.request("consortium:save", {"name": "duo", "members": ["openai/stub-ma", "openai/stub-mb"],
                                                   "arbiter": "openai/stub-judge"})

        async def agent_turns() -> list[str]:
            async with KsiClient(a.socket) as client:
                return [(await client.request("agent:send_message", {"agent_id": "scribe", "message": f"agent {t}",
                                                                     "wait": 120}))["response_id"] for t in range(3)]

        async def consortium_turns() -> list[str]:
            async with KsiClient(b.socket) as client:
                acks = [await client.request("completion:async", {"prompt": f"duo {t}", "conversation_id": "scribe",
                                                                  "model": "consortium/duo"}) for t in range(2)]
                return [(await client.request("completion:wait", {"request_id": ack["request_id"],
                                                                  "timeout": 120}))["response_id"] for ack in acks]

        async def plain_turns() -> list[str]:
            async with KsiClient(c.socket) as client:
                acks = [await client.request("completion:async", {"prompt": f"plain {t}", "conversation_id": "scribe"})
                        for t in range(3)]
                return [(await client.request("completion:wait", {"request_id": ack["request_id"],
                                                                  "timeout": 120}))["response_id"] for ack in acks]

        answered = [r for rs in await asyncio.gather(agent_turns(), consortium_turns(), plain_turns()) for r in rs]
        exchanges = await stored(a.var, pg_url, "scribe")

    assert [n for n, _r, _p in exchanges] == list(range(1, 10))
    assert sorted(answered) == sorted(r for _n, r, _p in exchanges[1:])
    prompts = [p for _n, _r, p in exchanges]
    turns = [r for r in stub.requests if not any(ARBITER_ASKS in str(m.get("content")) for m in r["messages"])]
    assert len(turns) == 3 + 1 + 3 + 2 * 2  # each agent and plain turn once, each consortium member once per run
    for request in turns:  # a consortium's members, like any turn, were shown every exchange stored before
        shown = user_turns(request["messages"])
        n = prompts.index(shown[-1])
        assert shown[:-1] == prompts[:n], (shown[-1], n, shown[:-1])


async def test_a_clean_stop_gives_back_the_leases_of_turns_that_just_ended(short_tmp: Path, pg_url: str,
                                                                          stub: Any) -> None:
    """A daemon stopped the moment its turns answered still gives their conversations' leases back:
    the next daemon on the database runs the next turns at once, not after the leases run out."""
    settings = stub_settings(stub, storage="postgres", database_url=pg_url, litellm_preload=False)
    conversations = [f"handed-{n}" for n in range(4)]
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        await asyncio.gather(*(complete(client, prompt="first", conversation_id=c, create=True)
                               for c in conversations))
    conn = await asyncpg.connect(pg_url)
    try:
        held = await conn.fetch("SELECT conversation_id FROM ksi_leases WHERE expires_at > now() "
                                "AND conversation_id = ANY($1::text[])", conversations)
    finally:
        await conn.close()
    assert held == []
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        second = await asyncio.gather(*(complete(client, prompt="second", conversation_id=c) for c in conversations))
    assert [s["exchange"] for s in second] == [2, 2, 2, 2]
