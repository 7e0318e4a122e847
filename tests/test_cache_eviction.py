"""A conversation evicted from the in-memory cache while its requests run is never loaded a second
time beside the first copy: two requests never both write exchange n, the later sees the earlier."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from ksi_common.records import read_index
from tests.conftest import connected, running_daemon, stub_settings


async def test_more_busy_conversations_than_the_cache_holds(short_tmp: Path, stub: Any) -> None:
    stub.hold = 0.3  # every turn 0 is still running while the later turns are admitted
    conversations = [f"c{k}" for k in range(6)]
    settings = stub_settings(stub, active_conversations=2, max_concurrency=6)
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        for conversation_id in conversations:
            await client.request("completion:async", {"prompt": f"{conversation_id} turn 0",
                                                      "conversation_id": conversation_id, "create": True})
        acks = []
        for turn in (1, 2, 3):
            for conversation_id in conversations:
                acks.append(await client.request("completion:async", {
                    "prompt": f"{conversation_id} turn {turn}", "conversation_id": conversation_id}))
        results = await asyncio.gather(*(client.request("completion:wait", {"request_id": a["request_id"],
                                                                            "timeout": 60}) for a in acks))
        assert all("content" in r for r in results)
        for conversation_id in conversations:
            assert [e.n for e in read_index(daemon.layout.index_file(conversation_id))] == [1, 2, 3, 4]
        # each request was sent every earlier turn of its conversation
        for body in stub.requests:
            users = [m["content"] for m in body["messages"] if m["role"] == "user"]
            conversation_id, _, turn = users[-1].partition(" turn ")
            assert users == [f"{conversation_id} turn {k}" for k in range(int(turn) + 1)], users
