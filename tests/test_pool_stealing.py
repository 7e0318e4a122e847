"""Work goes where there is room: turns a daemon at its limits accepted are claimed by daemons
with free slots (three daemon processes on one database), each run once, answered to the client
of the daemon that accepted it; a conversation's turns keep the order they were accepted in when
one of them is claimed by another daemon or taken over from a daemon that died."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from ksi_common.client import KsiClient
from tests.test_pool_order import daemon_processes, stored, user_turns


def calls_of(stub: Any, prompt: str) -> list[int]:
    """Indexes of the stub's calls whose newest user turn is `prompt`."""
    return [i for i, r in enumerate(stub.requests) if user_turns(r["messages"])[-1:] == [prompt]]


async def test_turns_sent_to_a_daemon_at_its_limits_are_run_by_the_daemons_with_free_slots(
        short_tmp: Path, pg_url: str, stub: Any) -> None:
    stub.hold = 0.3  # every call holds its slot a while: the daemon that accepted them is full
    turns = 30
    async with daemon_processes(short_tmp, pg_url, stub, via=True, KSI_MAX_CONCURRENCY="2") as (a, b, c), \
            KsiClient(a.socket) as on_a:
        acks = [await on_a.request("completion:async", {"prompt": f"turn {i}", "conversation_id": f"s{i}",
                                                        "create": True}) for i in range(turns)]
        results = [await on_a.request("completion:wait", {"request_id": ack["request_id"], "timeout": 120})
                   for ack in acks]
        healths = []
        for daemon in (a, b, c):
            async with KsiClient(daemon.socket) as client:
                healths.append(await client.request("system:health", {}))
        exchanges = [await stored(a.var, pg_url, f"s{i}") for i in range(turns)]

    # every turn answered once, to the client of the daemon that accepted it, under its ack's ids
    assert [r["response_id"] for r in results] == [ack["response_id"] for ack in acks]
    assert [r["content"] for r in results] == [f"stub answer to: turn {i}" for i in range(turns)]
    assert [[(p, r) for _n, r, p in e] for e in exchanges] == [[(f"turn {i}", ack["response_id"])]
                                                               for i, ack in enumerate(acks)]
    assert len(stub.requests) == turns  # none run twice
    # the other two daemons ran some of them, and no daemon ever made more than its 2 calls at once
    ran = {name: stub.via.count(name) for name in "abc"}
    assert ran["b"] > 0 and ran["c"] > 0 and sum(ran.values()) == turns, ran
    assert all(stub.max_in_flight_via[name] <= 2 for name in "abc"), stub.max_in_flight_via
    stolen = [h["storage"]["requests_stolen"] for h in healths]
    assert stolen[0] == 0 and stolen[1] == ran["b"] and stolen[2] == ran["c"], (stolen, ran)


async def test_a_conversations_turns_keep_their_order_when_claimed_by_other_daemons(
        short_tmp: Path, pg_url: str, stub: Any) -> None:
    # each daemon's one slot is taken by a slow call; B's frees first, then C's, then A's
    for name, seconds in (("stub-busy-a", 6.0), ("stub-busy-b", 1.5), ("stub-busy-c", 3.0)):
        stub.model_delay[name] = seconds
    async with daemon_processes(short_tmp, pg_url, stub, via=True, KSI_MAX_CONCURRENCY="1") as daemons:
        clients = [await KsiClient(d.socket).__aenter__() for d in daemons]
        on_a, on_b, on_c = clients
        try:
            opening = await on_a.request("completion:async", {"prompt": "opening", "conversation_id": "x",
                                                              "create": True})
            await on_a.request("completion:wait", {"request_id": opening["request_id"], "timeout": 60})
            busy = [await client.request("completion:async", {"prompt": f"busy {name}", "conversation_id": f"b{name}",
                                                              "create": True, "model": f"openai/stub-busy-{name}"})
                    for client, name in zip(clients, "abc", strict=True)]
            while len(stub.requests) < 4:  # every daemon's slot is held
                await asyncio.sleep(0.02)
            # accepted in this order on A, C and B: A's waits for a slot, the others for the lease
            order = [(on_a, "x1 on a"), (on_c, "x2 on c"), (on_b, "x3 on b")]
            acks = [await client.request("completion:async", {"prompt": prompt, "conversation_id": "x"})
                    for client, prompt in order]
            results = [await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 120})
                       for (client, _p), ack in zip(order, acks, strict=True)]
            for client, ack in zip(clients, busy, strict=True):
                await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 120})
        finally:
            for client in clients:
                await client.__aexit__(None, None, None)
        exchanges = await stored(daemons[0].var, pg_url, "x")

    assert [r["response_id"] for r in results] == [ack["response_id"] for ack in acks]
    prompts = [p for _n, _r, p in exchanges]
    assert prompts == ["opening", "x1 on a", "x2 on c", "x3 on b"]
    # B, free first, claimed A's turn though its own later turn waited there, and ran it first
    [x1] = calls_of(stub, "x1 on a")
    assert stub.via[x1] == "b"
    for prompt in prompts[1:]:  # each call shown every exchange stored before it, once
        [call] = calls_of(stub, prompt)
        assert user_turns(stub.requests[call]["messages"]) == prompts[:prompts.index(prompt) + 1]


async def test_turns_taken_over_from_a_dead_daemon_keep_their_place_in_the_line(
        short_tmp: Path, pg_url: str, stub: Any) -> None:
    stub.model_delay["stub-slow"] = 3.0  # A is killed while this call is at the model
    # the lease outlives the heartbeat: A's turns are taken over before its lease runs out
    async with daemon_processes(short_tmp, pg_url, stub, KSI_HEARTBEAT_TIMEOUT="2", KSI_POOL_LEASE="8") as (a, b, c), \
            KsiClient(a.socket) as on_a, KsiClient(b.socket) as on_b, KsiClient(c.socket) as on_c:
        opening = await on_b.request("completion:async", {"prompt": "opening", "conversation_id": "x", "create": True})
        await on_b.request("completion:wait", {"request_id": opening["request_id"], "timeout": 60})
        acks = [await on_a.request("completion:async", {"prompt": "slow on a", "conversation_id": "x",
                                                        "model": "openai/stub-slow"})]
        acks.append(await on_a.request("completion:async", {"prompt": "queued on a", "conversation_id": "x"}))
        while not calls_of(stub, "slow on a"):
            await asyncio.sleep(0.02)
        acks.append(await on_b.request("completion:async", {"prompt": "then on b", "conversation_id": "x"}))
        acks.append(await on_c.request("completion:async", {"prompt": "then on c", "conversation_id": "x"}))
        a.kill()
        results = [await on_c.request("completion:wait", {"request_id": ack["request_id"], "timeout": 120})
                   for ack in acks]
        exchanges = await stored(b.var, pg_url, "x")

    assert [r["response_id"] for r in results] == [ack["response_id"] for ack in acks]
    prompts = [p for _n, _r, p in exchanges]
    # the dead daemon's two turns ran again where they stood, before the turns accepted after them
    assert prompts == ["opening", "slow on a", "queued on a", "then on b", "then on c"]
    for prompt in prompts[2:]:
        [call] = calls_of(stub, prompt)
        assert user_turns(stub.requests[call]["messages"]) == prompts[:prompts.index(prompt) + 1]
