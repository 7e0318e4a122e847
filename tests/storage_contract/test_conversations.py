"""The contract of `ConversationStore`, on every backend: exclusive creates, appends read back in
order, the conditional append's conflict, tails within a budget, digests, moves and deletes."""

from __future__ import annotations

import asyncio
from contextlib import nullcontext

import pytest

from ksi_common.storage_backends import Backend
from ksi_daemon.storage.models import ConversationMeta, PendingInput
from ksi_daemon.storage.ports import ConversationExists, DigestMatch, ExchangeConflict, Storage
from tests.storage_contract.conftest import Opener, entry, response_lines


async def test_a_conversation_is_created_once_and_read_back(storage: Storage) -> None:
    store = storage.conversations
    assert not await store.exists("c") and await store.load_meta("c") is None and await store.head("c") == 0
    await store.create(ConversationMeta(conversation_id="c", title="first", tags=["x"]))
    with pytest.raises(ConversationExists) as taken:
        await store.create(ConversationMeta(conversation_id="c", title="second"))
    assert taken.value.conversation_id == "c"
    meta = await store.load_meta("c")
    assert meta is not None and meta.title == "first" and meta.tags == ["x"]
    assert await store.exists("c") and await store.conversation_ids() == ["c"]
    await store.save_meta(meta.model_copy(update={"title": "renamed"}))
    assert (await store.load_meta("c")).title == "renamed"  # type: ignore[union-attr]
    assert await store.metas(["c", "missing"]) == [(await store.all_metas())[0], None]


async def test_pending_input_is_read_back_after_a_restart_and_cleared_with_its_reply(
        storage: Storage, open_storage: Opener) -> None:
    waiting = [PendingInput(id="pend-1", content="hello", ts="2026-01-01T00:00:00Z"),
               PendingInput(id="pend-2", content="42", ts="2026-01-01T00:00:01Z",
                            item={"type": "function_call_output", "call_id": "call-1", "output": "42"})]
    await storage.conversations.create(ConversationMeta(conversation_id="c", pending_input=waiting))
    async with open_storage() as again:
        meta = await again.conversations.load_meta("c")
        assert meta is not None and meta.pending_input == waiting and meta.extra == {}
        e = entry(1)  # the exchange answering it clears it, in the same write as its index line
        await again.conversations.append_exchange("c", e, response=response_lines(e, "c"),
                                                  meta=meta.model_copy(update={"pending_input": None}))
    async with open_storage() as third:
        meta = await third.conversations.load_meta("c")
        assert meta is not None and meta.pending_input is None
        assert [x.n for x in await third.conversations.entries("c")] == [1]


async def test_appended_exchanges_read_back_in_order_after_a_restart(storage: Storage, open_storage: Opener) -> None:
    await storage.conversations.create(ConversationMeta(conversation_id="c"))
    written = [entry(n) for n in range(1, 8)]
    for e in written:
        await storage.conversations.append_exchange("c", e, response=response_lines(e, "c"))
    async with open_storage() as again:
        assert await again.conversations.entries("c") == written
        assert await again.conversations.head("c") == 7
        record = await again.responses.read(written[2].response_id)
        assert record is not None and record.content == "a3" and record.inputs[0]["content"] == "q3"


async def test_an_exchange_number_taken_is_refused_with_the_head_and_writes_nothing(storage: Storage) -> None:
    store = storage.conversations
    await store.create(ConversationMeta(conversation_id="c", title="kept"))
    for n in (1, 2):
        e = entry(n)
        await store.append_exchange("c", e, response=response_lines(e, "c"))
    late = entry(2)
    with pytest.raises(ExchangeConflict) as conflict:
        await store.append_exchange("c", late, meta=ConversationMeta(conversation_id="c", title="lost"))
    assert (conflict.value.n, conflict.value.head) == (2, 2)
    assert [e.n for e in await store.entries("c")] == [1, 2]
    assert (await store.load_meta("c")).title == "kept"  # type: ignore[union-attr]


async def test_concurrent_appends_of_one_number_let_exactly_one_through(storage: Storage, open_storage: Opener,
                                                                        contract_backend: Backend) -> None:
    """Two writers of exchange n: one is indexed, the other learns the head and renumbers. A shared
    backend promises it across daemons; every backend promises it within one."""
    await storage.conversations.create(ConversationMeta(conversation_id="c"))
    # a backend no other daemon shares has one writer: the two appends race within it
    async with open_storage() if contract_backend.shared else nullcontext(storage) as other:
        for n in range(1, 11):
            a, b = entry(n), entry(n)
            outcomes = await asyncio.gather(
                storage.conversations.append_exchange("c", a, response=response_lines(a, "c")),
                other.conversations.append_exchange("c", b, response=response_lines(b, "c")),
                return_exceptions=True)
            conflicts = [o for o in outcomes if isinstance(o, ExchangeConflict)]
            assert len(conflicts) == 1 and outcomes.count(None) == 1, outcomes
            assert conflicts[0].head == n
    assert [e.n for e in await storage.conversations.entries("c")] == list(range(1, 11))


async def test_the_tail_is_the_newest_exchanges_within_the_budget_feedback_left_out(storage: Storage) -> None:
    store = storage.conversations
    await store.create(ConversationMeta(conversation_id="c"))
    for n in range(1, 11):
        e = entry(n, tokens=10, feedback=n == 9)
        await store.append_exchange("c", e, response=response_lines(e, "c"))
    tail, head = await store.read_tail("c", 35)
    assert head == 10 and [e.n for e in tail] == [7, 8, 10]
    assert await store.read_tail("c", 0) == ([], 10)
    assert await store.read_tail("missing", 100) == ([], 0)
    assert await store.moved_since("c", 10, 35) is None
    moved = await store.moved_since("c", 8, 35)
    assert moved is not None and moved.head == 10 and [e.n for e in moved.entries] == [7, 8, 10]


async def test_an_exchange_is_found_by_its_digest(storage: Storage) -> None:
    store = storage.conversations
    await store.create(ConversationMeta(conversation_id="c"))
    for n in (1, 2):
        e = entry(n, digest=f"d{n}")
        await store.append_exchange("c", e, response=response_lines(e, "c"))
    assert await store.find_digest("d2") == [DigestMatch("c", 2)]
    assert await store.find_digest("nowhere") == []


async def test_a_move_takes_the_history_and_its_forks_along(storage: Storage) -> None:
    store = storage.conversations
    await store.create(ConversationMeta(conversation_id="a", title="t"))
    kept = [entry(n) for n in (1, 2)]
    for e in kept:
        await store.append_exchange("a", e, response=response_lines(e, "a"))
    await store.create(ConversationMeta(conversation_id="f", parent_id="a", fork_at=1))
    assert await store.forks_of("a") == ["f"]
    assert await store.move("a", "a-old", {"reset_at": "now"}) == ["f"]
    assert not await store.exists("a") and await store.entries("a-old") == kept
    moved = await store.load_meta("a-old")
    assert moved is not None and moved.title == "t" and moved.extra == {"reset_at": "now"}
    assert (await store.load_meta("f")).parent_id == "a-old"  # type: ignore[union-attr]


async def test_a_delete_removes_the_conversation_and_its_own_responses(storage: Storage) -> None:
    store = storage.conversations
    await store.create(ConversationMeta(conversation_id="c"))
    e = entry(1)
    await store.append_exchange("c", e, response=response_lines(e, "c"))
    assert not await store.discard_unused("c")  # it holds an exchange: kept
    removed = await store.delete("c")
    assert removed and not await store.exists("c") and await store.load_meta("c") is None
    assert await storage.responses.read(e.response_id) is None
    gone = await store.moved_since("c", 1, 100)
    assert gone is not None and gone.meta is None
    await store.create(ConversationMeta(conversation_id="empty"))
    assert await store.discard_unused("empty") and not await store.exists("empty")


async def test_an_import_is_created_whole_and_exclusively(storage: Storage) -> None:
    store = storage.conversations
    exchanges = [(e, response_lines(e, "imp")) for e in (entry(1), entry(2))]
    await store.import_conversation(ConversationMeta(conversation_id="imp", title="i"), exchanges)
    with pytest.raises(ConversationExists):
        await store.import_conversation(ConversationMeta(conversation_id="imp"), exchanges)
    assert [e.n for e in await store.entries("imp")] == [1, 2]
    assert (await store.load_meta("imp")).title == "i"  # type: ignore[union-attr]
