"""A write waiting for a conversation's lock while the conversation is deleted or moved writes
nothing after it: the stale memory would bring the conversation back (a JSONL metadata file made
again, a PostgreSQL row inserted by the append)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from ksi_common.errors import ErrorCode, KsiError
from ksi_daemon.daemon import Daemon
from ksi_daemon.services.conversations.memory import ConversationMemory
from tests.conftest import complete, connected

pytestmark = pytest.mark.backends


async def waiting_for(memory: ConversationMemory) -> None:
    for _ in range(500):
        if memory.lock._waiters:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("nothing waited for the conversation's lock")


WRITES = {
    "conversation:pend": lambda cid: {"conversation_id": cid, "inputs": ["late"]},
    "conversation:append": lambda cid: {"conversation_id": cid, "exchanges": [{"inputs": ["late"], "reply": "r"}]},
    "conversation:update": lambda cid: {"conversation_id": cid, "title": "late"},
}


@pytest.mark.parametrize("retired", ["deleted", "moved"])
@pytest.mark.parametrize("event", sorted(WRITES))
async def test_a_write_waiting_while_its_conversation_is_deleted_or_moved_does_not_bring_it_back(
        stub_daemon: Daemon, stub: Any, event: str, retired: str) -> None:
    async with connected(stub_daemon) as client:
        cid = (await complete(client, prompt="p1"))["conversation_id"]
        memory = await stub_daemon.cache.get(cid)
        assert memory is not None
        writer = stub_daemon.writer
        async with memory.lock:  # the delete or an agent reset's move, run under the lock as they are
            write = asyncio.ensure_future(client.request(event, WRITES[event](cid)))
            await waiting_for(memory)
            if retired == "deleted":
                await writer.delete(memory)
                stub_daemon.cache.forget(cid)
            else:
                await writer.move(cid, f"{cid}-before", {"reset": True}, memory)
        with pytest.raises(KsiError) as refused:
            await write
        assert refused.value.code == ErrorCode.CONVERSATION_NOT_FOUND, refused.value
        assert refused.value.details.get("conversation_id") == cid
        assert not await writer.stored(cid)
        assert await writer.load_meta(cid) is None
        with pytest.raises(KsiError) as shown:
            await client.request("conversation:show", {"conversation_id": cid})
        assert shown.value.code == ErrorCode.CONVERSATION_NOT_FOUND
        if retired == "moved":  # the moved conversation is as it was: the late write is not in it
            moved = await writer.load_meta(f"{cid}-before")
            assert moved is not None and moved.title != "late" and not moved.extra.get("pending_input")
            assert len(await writer.reader.entries(f"{cid}-before")) == 1
