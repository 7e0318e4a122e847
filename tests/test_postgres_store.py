"""The PostgreSQL stores against a real server: the same answers as the JSONL store for the same
writes, the conditional append under two writers, the journal per daemon, the event relay."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from ksi_common.layout import VarLayout
from ksi_common.records import IndexEntry
from ksi_common.summaries import Summary
from ksi_daemon.services.conversations.memory import ConversationCache
from ksi_daemon.storage.jsonl.conversations import JsonlConversations
from ksi_daemon.storage.jsonl.responses import JsonlResponses
from ksi_daemon.storage.models import ConversationMeta
from ksi_daemon.storage.ports import ConversationExists, ExchangeConflict, StoredTail
from ksi_daemon.storage.postgres.conversations import PostgresConversations
from ksi_daemon.storage.postgres.database import Database
from ksi_daemon.storage.postgres.records import (
    PostgresCalibration,
    PostgresConsortia,
    PostgresResponses,
    PostgresSummaries,
)
from ksi_daemon.storage.postgres.relay import PostgresRelay


@pytest.fixture
async def database(pg_url: str) -> AsyncIterator[Database]:
    db = Database(pg_url)
    await db.open()
    try:
        yield db
    finally:
        await db.close()


def entry(n: int, tokens: int = 10, feedback: bool = False) -> IndexEntry:
    return IndexEntry(n=n, response_id=f"m-{n:04d}-{random.getrandbits(32):08x}", ts="2026-01-01T00:00:00Z",
                      model="m", tokens_in=tokens // 2, tokens_out=tokens - tokens // 2, is_feedback=feedback)


def lines(e: IndexEntry, conversation_id: str) -> list[dict[str, Any]]:
    return [{"v": 1, "type": "user", "content": f"q{e.n}", "conversation_id": conversation_id},
            {"v": 1, "type": "assistant", "content": f"a{e.n}", "conversation_id": conversation_id}]


def both_stores(database: Database, root: Path) -> tuple[JsonlConversations, PostgresConversations]:
    """The conversation store over files in `root` and over the database, to write alike."""
    layout = VarLayout(root)
    for directory in (layout.responses_dir, layout.conversations_dir, layout.conversation_meta_dir):
        directory.mkdir(parents=True)
    return JsonlConversations(layout, fsync=False), PostgresConversations(database)


async def test_the_tail_within_a_budget_is_the_one_the_files_give(database: Database, short_tmp: Path) -> None:
    rng = random.Random(7)
    files, rows = both_stores(database, short_tmp)
    for store in (files, rows):
        await store.create(ConversationMeta(conversation_id="c1"))
    for n in range(1, 121):
        e = entry(n, tokens=rng.randint(0, 60), feedback=rng.random() < 0.15)
        for store in (files, rows):
            await store.append_exchange("c1", e, response=lines(e, "c1"))
    for budget in (0, 1, 7, 50, 333, 1000, 2500, 10_000):
        assert await rows.read_tail("c1", budget) == await files.read_tail("c1", budget)
    assert await rows.entries("c1") == await files.entries("c1")
    assert await rows.head("c1") == await files.head("c1") == 120
    assert await rows.read_tail("nope", 100) == ([], 0)


async def test_two_writers_of_one_exchange_number_one_wins_the_other_learns_the_head(pg_url: str,
                                                                                      database: Database) -> None:
    other_db = Database(pg_url)
    await other_db.open()
    try:
        a, b = PostgresConversations(database), PostgresConversations(other_db)
        await a.create(ConversationMeta(conversation_id="c"))
        with pytest.raises(ConversationExists):
            await b.create(ConversationMeta(conversation_id="c"))
        for n in range(1, 31):
            ea, eb = entry(n), entry(n)
            outcomes = await asyncio.gather(a.append_exchange("c", ea, response=lines(ea, "c")),
                                            b.append_exchange("c", eb, response=lines(eb, "c")),
                                            return_exceptions=True)
            conflicts = [o for o in outcomes if isinstance(o, ExchangeConflict)]
            assert len(conflicts) == 1 and outcomes.count(None) == 1, outcomes
            assert conflicts[0].head == n
        assert [e.n for e in await b.entries("c")] == list(range(1, 31))
        # an append repeated after its answer was lost is not a conflict and writes nothing twice
        last = (await a.entries("c"))[-1]
        await b.append_exchange("c", last, response=[])
        assert len(await a.entries("c")) == 30
        with pytest.raises(ExchangeConflict):
            await b.append_exchange("c", entry(30))
    finally:
        await other_db.close()


async def test_moved_since_answers_as_the_files_do(database: Database, short_tmp: Path) -> None:
    files, rows = both_stores(database, short_tmp)
    for store in (files, rows):
        await store.create(ConversationMeta(conversation_id="c", title="t"))
        assert await store.moved_since("c", 0, 100) is None
    for n in range(1, 13):
        e = entry(n, tokens=20, feedback=n == 11)
        for store in (files, rows):
            await store.append_exchange("c", e, response=lines(e, "c"))
    for head in (0, 5, 11):
        for budget in (0, 45, 10_000):
            answers = [await store.moved_since("c", head, budget) for store in (files, rows)]
            for store, moved in zip((files, rows), answers, strict=True):
                assert moved == StoredTail(await store.load_meta("c"), *await store.read_tail("c", budget))
            assert answers[0].entries == answers[1].entries and answers[1].head == 12
    for store in (files, rows):
        assert await store.moved_since("c", 12, 45) is None
        await store.delete("c")
        gone = await store.moved_since("c", 12, 45)
        assert gone is not None and gone.meta is None


async def test_a_cache_finds_another_daemons_exchange_in_one_round_trip(pg_url: str, database: Database) -> None:
    """Daemon A holds a conversation in memory; B appends to it; A's next lookup costs one
    database call, whether the head moved or not, and never serves the stale history."""
    other_db = Database(pg_url)
    await other_db.open()
    try:
        a, b = PostgresConversations(database), PostgresConversations(other_db)
        cache = ConversationCache(a, PostgresResponses(database), capacity=10)
        await a.create(ConversationMeta(conversation_id="c"))
        first = entry(1)
        await a.append_exchange("c", first, response=lines(first, "c"))
        held = await cache.require("c", budget=1000)
        assert [e.n for e in held.entries] == [1]
        calls = database.calls
        assert await cache.require("c", budget=1000) is held  # nothing moved: the same memory
        assert database.calls == calls + 1
        second = entry(2)
        await b.append_exchange("c", second, response=lines(second, "c"))
        calls = database.calls
        now = await cache.require("c", budget=1000)
        assert database.calls == calls + 1
        assert now is not held and [e.response_id for e in now.entries] == [first.response_id, second.response_id]
        assert now.total == 2 and now.next_n == 3
        third = entry(3)  # A appends after B without a conflict: its metadata version is current
        await a.append_exchange("c", third, response=lines(third, "c"), meta=ConversationMeta(conversation_id="c"))
        await b.delete("c")
        calls = database.calls
        assert await cache.get("c") is None
        assert database.calls == calls + 1 and cache.cached("c") is None
    finally:
        await other_db.close()


async def test_move_delete_and_import_keep_what_the_files_keep(database: Database) -> None:
    rows = PostgresConversations(database)
    responses = PostgresResponses(database)
    await rows.create(ConversationMeta(conversation_id="agent-1", title="t"))
    kept = []
    for n in (1, 2, 3):
        e = entry(n)
        kept.append(e)
        await rows.append_exchange("agent-1", e, response=lines(e, "agent-1"))
    await rows.create(ConversationMeta(conversation_id="fork-1", parent_id="agent-1", fork_at=2))
    forks = await rows.move("agent-1", "agent-1-old", {"reset_at": "now"})
    assert forks == ["fork-1"]
    assert await rows.exists("agent-1") is False
    moved = await rows.load_meta("agent-1-old")
    assert moved is not None and moved.title == "t" and moved.extra == {"reset_at": "now"}
    assert [e.response_id for e in await rows.entries("agent-1-old")] == [e.response_id for e in kept]
    assert (await rows.load_meta("fork-1")).parent_id == "agent-1-old"  # type: ignore[union-attr]
    assert await rows.forks_of("agent-1-old") == ["fork-1"]
    new = entry(4)
    await rows.append_exchange("agent-1-old", new, response=lines(new, "agent-1-old"))

    imported = [(entry(n), lines(entry(n), "imp")) for n in (1, 2)]
    await rows.import_conversation(ConversationMeta(conversation_id="imp"), imported)
    with pytest.raises(ConversationExists):
        await rows.import_conversation(ConversationMeta(conversation_id="imp"), imported)
    assert [e.n for e in await rows.entries("imp")] == [1, 2]
    assert (await rows.read_tail("imp", 10_000))[1] == 2

    removed = await rows.delete("agent-1-old")
    assert removed == sorted([f"logs/responses/{e.response_id}.jsonl" for e in [*kept, new]]
                             + ["logs/conversations/agent-1-old.jsonl", "state/conversations/agent-1-old.json"])
    assert await responses.read_many([kept[0].response_id, imported[0][0].response_id]) == [
        None, await responses.read(imported[0][0].response_id)]
    assert await rows.conversation_ids() == ["fork-1", "imp"]


async def test_consortium_definitions_keep_their_first_creation_time(database: Database) -> None:
    store = PostgresConsortia(database)
    first, replaced = await store.save("team", {"members": ["a"]})
    assert not replaced
    second, replaced = await store.save("team", {"members": ["a", "b"]})
    assert replaced and second["created"] == first["created"] and second["members"] == ["a", "b"]
    assert await store.load("team") == second
    assert await store.load_all() == {"team": second}
    assert await store.remove("team") and not await store.remove("team")


async def test_events_reach_the_other_daemons_and_not_their_sender(pg_url: str, database: Database) -> None:
    got: dict[str, list[tuple[str, dict[str, Any]]]] = {"a": [], "b": []}
    relays = {name: PostgresRelay(database, name) for name in ("a", "b")}
    for name, relay in relays.items():
        await relay.start(lambda event, data, _ctx, name=name: got[name].append((event, data)))
    try:
        relays["a"].publish("completion:result", {"content": "small"}, {"event_id": "e1"})
        relays["a"].publish("completion:result", {"content": "x" * 20_000}, {"event_id": "e2"})
        for _ in range(200):
            if len(got["b"]) == 2:
                break
            await asyncio.sleep(0.02)
        assert [data["content"][:5] for _e, data in got["b"]] == ["small", "xxxxx"]
        assert len(got["b"][1][1]["content"]) == 20_000
        assert got["a"] == []
    finally:
        for relay in relays.values():
            await relay.stop()


async def test_summaries_follow_their_conversation_and_calibration_is_one_document(database: Database) -> None:
    rows = PostgresConversations(database)
    summaries, calibration = PostgresSummaries(database), PostgresCalibration(database)
    await rows.create(ConversationMeta(conversation_id="long"))
    for n in (1, 2):
        e = entry(n)
        await rows.append_exchange("long", e, response=lines(e, "long"))
    await summaries.append(Summary("long", 1, "one"))
    await summaries.append(Summary("long", 2, "one and two", previous_upto=1))
    await rows.move("long", "long-1", {})
    assert [(s.upto, s.text) for s in await summaries.read("long-1")] == [(1, "one"), (2, "one and two")]
    assert await summaries.read("long") == []  # a fresh conversation under the old id starts without them
    assert [s.upto for s in await rows.summaries("long-1")] == [1, 2]  # the read port sees them too
    assert "logs/summaries/long-1.jsonl" in await rows.delete("long-1")
    assert await summaries.read("long-1") == []
    assert await calibration.load() == {}
    await calibration.save({"m": {"ratio": 1.2, "samples": 3}})
    await calibration.save({"m": {"ratio": 1.1, "samples": 4}})
    assert await calibration.load() == {"m": {"ratio": 1.1, "samples": 4}}


async def test_adopt_moves_a_conversation_into_another_as_the_files_do(database: Database,
                                                                             short_tmp: Path) -> None:
    files, rows = both_stores(database, short_tmp)
    readers = (JsonlResponses(VarLayout(short_tmp), fsync=False), PostgresResponses(database))
    made = [entry(1), entry(2)]
    other = entry(1)
    for store in (files, rows):
        await store.create(ConversationMeta(conversation_id="session", title="mine"))
        await store.create(ConversationMeta(conversation_id="run", exchanges=2))
        await store.create(ConversationMeta(conversation_id="held"))
        for e in made:
            await store.append_exchange("run", e, response=lines(e, "run"))
        await store.append_exchange("held", other, response=lines(other, "held"))
    for store, responses in zip((files, rows), readers, strict=True):
        # a target that holds an exchange takes nothing: both stay as they were
        refused = ConversationMeta(conversation_id="held", exchanges=3)
        assert await store.adopt("held", "run", refused) is False
        assert [e.n for e in await store.entries("held")] == [1] and await store.head("run") == 2
        assert await store.adopt("session", "gone", ConversationMeta(conversation_id="session")) is False
        taken = ConversationMeta(conversation_id="session", title="mine", exchanges=2)
        assert await store.adopt("session", "run", taken) is True
        assert await store.exists("run") is False
        assert [e.response_id for e in await store.entries("session")] == [e.response_id for e in made]
        assert await store.head("session") == 2
        meta = await store.load_meta("session")
        assert meta is not None and (meta.title, meta.exchanges) == ("mine", 2)
        for e in made:  # the records name the conversation that now lists them
            record = await responses.read(e.response_id)
            assert record is not None
            assert {line["conversation_id"] for line in (*record.inputs, record.outcome)} == {"session"}
        later = entry(3)
        await store.append_exchange("session", later, response=lines(later, "session"))
    copied = [entry(1), entry(2), entry(3)]
    for store in (files, rows):  # a target's exchanges replaced by a source that begins with their copy
        await store.create(ConversationMeta(conversation_id="opened"))
        await store.append_exchange("opened", other, response=lines(other, "opened"))
        await store.create(ConversationMeta(conversation_id="copy"))
        for e in copied:
            await store.append_exchange("copy", e, response=lines(e, "copy"))
        assert await store.adopt("opened", "copy", ConversationMeta(conversation_id="opened"), replaced=0) is False
        assert await store.adopt("opened", "copy", ConversationMeta(conversation_id="opened", exchanges=3),
                                 replaced=1) is True
        assert [e.response_id for e in await store.entries("opened")] == [e.response_id for e in copied]
        assert await store.head("opened") == 3 and await store.exists("copy") is False
