"""A commit of several exchanges (conversation:append) that fails part-way: what was written keeps
the conversation true (the pending input replied to is not left waiting), and a failure known
before the first write writes nothing."""

from __future__ import annotations

from typing import Any

import pytest

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.items import message
from ksi_common.records import IndexEntry
from ksi_daemon.daemon import Daemon
from ksi_daemon.services.conversations.memory import Exchange
from ksi_daemon.services.conversations.pending import pending_of
from ksi_daemon.services.conversations.writer import NewExchange
from tests.conftest import complete, connected

pytestmark = pytest.mark.backends


class FailingOnAppend:
    """The daemon's conversation store, where append number `failing` (from 1) fails like a database
    error; every other call passes through."""

    def __init__(self, store: Any, failing: int) -> None:
        self.store = store
        self.failing = failing

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    async def append_exchange(self, conversation_id: str, entry: IndexEntry, **kwargs: Any) -> None:
        self.failing -= 1
        if self.failing == 0:
            raise OSError("the store failed")
        await self.store.append_exchange(conversation_id, entry, **kwargs)


async def test_an_append_failing_at_its_second_exchange_leaves_no_answered_input_waiting(
        stub_daemon: Daemon, stub: Any) -> None:
    async with connected(stub_daemon) as client:
        cid = (await complete(client, prompt="p0"))["conversation_id"]
        await client.request("conversation:pend", {"conversation_id": cid, "inputs": ["p1"]})
        writer = stub_daemon.writer
        store = writer._store
        writer._store = FailingOnAppend(store, failing=2)
        try:
            with pytest.raises(KsiError) as failed:
                await client.request("conversation:append", {"conversation_id": cid, "reply_to_pending": "r1",
                                                              "exchanges": [{"inputs": ["two"], "reply": "2"}]})
        finally:
            writer._store = store
        assert failed.value.code == ErrorCode.INTERNAL_ERROR
        entries = await writer.reader.entries(cid)
        assert len(entries) == 2  # the reply to p1 was stored, the exchange after it not: p1 waits no more
        meta = await writer.load_meta(cid)
        assert meta is not None and not pending_of(meta)
        memory = await stub_daemon.cache.require(cid)
        assert memory.total == 2 and not pending_of(memory.meta)
        await complete(client, prompt="p3", conversation_id=cid)
        assert [m["content"] for m in stub.messages()].count("p1") == 1


def new_exchange(text: str) -> NewExchange:
    lines = [{"v": 1, "type": "user", "content": text}, {"v": 1, "type": "assistant", "content": text.upper()}]
    return NewExchange(IndexEntry(n=0, response_id=f"appended-{text}", ts="2026-01-01T00:00:00Z"), lines,
                       Exchange(input=[message("user", text)], output=[message("assistant", text.upper())]))


async def test_a_commit_whose_metadata_is_refused_writes_none_of_its_exchanges(stub_daemon: Daemon) -> None:
    async with connected(stub_daemon) as client:
        cid = (await complete(client, prompt="p0"))["conversation_id"]
    writer = stub_daemon.writer
    memory = await stub_daemon.cache.require(cid)

    def refused(_meta: Any, _entries: list[IndexEntry]) -> Any:
        raise KsiError(ErrorCode.VALIDATION_ERROR, "too many pending messages", fields={"pending": "at most 1000"})

    async with memory.lock:
        with pytest.raises(KsiError) as failed:
            await writer.commit(memory, [new_exchange("one"), new_exchange("two")], None, refused)
    assert failed.value.code == ErrorCode.VALIDATION_ERROR
    assert len(await writer.reader.entries(cid)) == 1 and memory.total == 1
    meta = await writer.load_meta(cid)
    assert meta is not None and meta.exchanges == 1
