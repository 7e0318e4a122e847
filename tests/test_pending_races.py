"""Pending input (conversation:pend) and the metadata updates that race with the commit taking it."""

from __future__ import annotations

import asyncio
from typing import Any

from ksi_daemon.daemon import Daemon
from tests.conftest import complete, connected


async def test_a_metadata_update_during_a_commit_never_brings_taken_pending_input_back(
        stub_daemon: Daemon, stub: Any) -> None:
    async with connected(stub_daemon) as client:
        first = await complete(client, prompt="p1")
        cid = first["conversation_id"]
        await client.request("conversation:pend", {"conversation_id": cid, "inputs": ["PENDING-Q"]})
        memory = await stub_daemon.cache.get(cid)
        assert memory is not None
        await memory.lock.acquire()  # stands for a commit's write under way: it fixes the order of events
        ack = await client.request("completion:async", {"prompt": "p2", "conversation_id": cid})
        for _ in range(500):  # the request took PENDING-Q and waits to commit
            if memory.lock._waiters:
                break
            await asyncio.sleep(0.01)
        update = asyncio.ensure_future(client.request("conversation:update",
                                                      {"conversation_id": cid, "metadata": {"k": "v"}}))
        await asyncio.sleep(0.1)
        memory.lock.release()
        await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 30})
        updated = await update
        assert updated["updated"] == ["extra"]
        shown = await client.request("conversation:show", {"conversation_id": cid})
        assert not shown["conversation"].get("pending_input")
        assert (shown["conversation"].get("extra") or {}).get("metadata", {"k": "v"}) == {"k": "v"}
        await complete(client, prompt="p3", conversation_id=cid)
        assert [m["content"] for m in stub.messages()].count("PENDING-Q") == 1

