"""The database restarted while three daemons run turns: each accepted turn is answered once and
stored once, in its conversation's order (or, when it could not reach the database within its
waits on a starved machine, reported failed with storage_unavailable and stored nowhere), the daemons say the database is away in their health
while it is, and go on (leases, heartbeats, offers) when it is back, without a restart of theirs."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from ksi_common.client import KsiClient
from ksi_common.errors import KsiError
from tests.pg_cluster import ThrowawayCluster
from tests.test_pool_order import daemon_processes, stored, user_turns

CONVERSATIONS, TURNS = 6, 4


async def health_of(socket: Path) -> dict[str, Any]:
    async with KsiClient(socket) as client:
        return dict(await client.request("system:health", {}))


async def test_the_database_restarted_mid_run_loses_and_doubles_nothing(
        short_tmp: Path, pg_cluster: ThrowawayCluster, pg_url: str, stub: Any) -> None:
    stub.hold = 0.4  # turns are at the model, running and queued, when the server goes down
    async with daemon_processes(short_tmp, pg_url, stub, via=True, KSI_MAX_CONCURRENCY="2",
                                KSI_HEARTBEAT_TIMEOUT="2", KSI_POOL_LEASE="20") as daemons:
        clients = [await KsiClient(d.socket).__aenter__() for d in daemons]
        try:
            acks: list[list[dict[str, Any]]] = []
            for i in range(CONVERSATIONS):  # each conversation's turns accepted by the three daemons in turn
                acks.append([await clients[(i + t) % 3].request(
                    "completion:async", {"prompt": f"r{i} t{t}", "conversation_id": f"r{i}", "create": True})
                    for t in range(TURNS)])
            while len(stub.requests) < 4:
                await asyncio.sleep(0.02)
            await asyncio.to_thread(pg_cluster.stop, "fast")  # as `pg_ctl restart -m fast`, held down longer
            try:
                # the server is away longer than the heartbeat timeout: each daemon says so
                outage = []
                for daemon in daemons:
                    for _ in range(200):
                        health = await health_of(daemon.socket)
                        if health["cluster"]["error"] is not None:
                            break
                        await asyncio.sleep(0.05)
                    outage.append(health)
                with pytest.raises(KsiError) as refused:  # not accepted, so nothing to answer for later
                    await clients[0].request("completion:async", {"prompt": "while away", "conversation_id": "r0"})
                assert refused.value.code == "storage_unavailable"
                await asyncio.sleep(2.5)
            finally:
                await asyncio.to_thread(pg_cluster.start)
            async def outcome(client: KsiClient, request_id: str) -> dict[str, Any] | None:
                try:
                    return dict(await client.request("completion:wait", {"request_id": request_id, "timeout": 120}))
                except KsiError as error:  # reported, never silent: and then stored nowhere (below)
                    assert error.code == "storage_unavailable", error
                    return None

            results = [[await outcome(clients[(i + t) % 3], ack["request_id"]) for t, ack in enumerate(conversation)]
                       for i, conversation in enumerate(acks)]
            # the turns accepted after it came back run as before: leases and offers work again
            after = [await clients[i % 3].request("completion:async", {"prompt": f"r{i} after", "conversation_id": f"r{i}"})
                     for i in range(CONVERSATIONS)]
            later = [await clients[i % 3].request("completion:wait", {"request_id": ack["request_id"], "timeout": 120})
                     for i, ack in enumerate(after)]
            await asyncio.sleep(1.0)  # a heartbeat or more after the last turn
            healths = [await health_of(d.socket) for d in daemons]
        finally:
            for client in clients:
                await client.__aexit__(None, None, None)
        exchanges = [await stored(daemons[0].var, pg_url, f"r{i}") for i in range(CONVERSATIONS)]

    for health in outage:
        assert health["cluster"]["error"] is not None
    answered_in_all = 0
    for i, conversation in enumerate(acks):
        # every answered turn under its ack's ids, stored once, in the order accepted; a failed one nowhere
        answered = [(t, a) for t, a in enumerate(conversation) if results[i][t] is not None]
        answered_in_all += len(answered)
        assert [results[i][t]["response_id"] for t, _a in answered] == [a["response_id"] for _t, a in answered]
        assert [(p, r) for _n, r, p in exchanges[i]] == [
            *((f"r{i} t{t}", a["response_id"]) for t, a in answered),
            (f"r{i} after", after[i]["response_id"])]
        assert later[i]["exchange"] == len(answered) + 1
    assert answered_in_all >= CONVERSATIONS * TURNS // 2  # the outage fails few, if any
    prompts = [user_turns(r["messages"])[-1] for r in stub.requests]
    stored_prompts = [p for e in exchanges for _n, _r, p in e]
    assert set(stored_prompts) <= set(prompts)
    assert all(prompts.count(p) == 1 for p in stored_prompts)  # no stored turn was called twice
    for health in healths:  # back to normal without a restart of any daemon: all three seen alive
        assert health["cluster"]["error"] is None
        assert [d["state"] for d in health["cluster"]["daemons"]] == ["alive"] * 3
        assert health["storage"]["requests_taken_over"] == 0  # none of the live daemons was thought dead
