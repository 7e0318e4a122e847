"""The one write path of conversations under two daemons sharing one PostgreSQL database: exchanges a
client appends (`conversation:append`) while another daemon commits a turn of the same conversation
land after that turn, as a completion's commit does, instead of failing with the stored head moved."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.items import message
from ksi_common.records import IndexEntry
from ksi_common.settings import Settings
from ksi_daemon.context import EventContext
from ksi_daemon.router import Router
from ksi_daemon.services.conversations.memory import ConversationCache, Exchange
from ksi_daemon.services.conversations.models import ConversationAppend, ConversationPend
from ksi_daemon.services.conversations.pending import pending_of
from ksi_daemon.services.conversations.service import ConversationService
from ksi_daemon.services.conversations.writer import ConversationWriter, NewExchange
from ksi_daemon.storage.models import ConversationMeta
from ksi_daemon.storage.postgres.blobs import PostgresBlobs
from ksi_daemon.storage.postgres.conversations import PostgresConversations
from ksi_daemon.storage.postgres.database import Database
from ksi_daemon.storage.postgres.records import PostgresResponses, PostgresSummaries


class AnotherDaemonFirst:
    """A daemon's conversation store, where another daemon's write lands just before this daemon's
    next append reaches the database (the moment two daemons race for one exchange number)."""

    def __init__(self, store: PostgresConversations) -> None:
        self.store = store
        self.before: Callable[[], Awaitable[None]] | None = None
        self.passing = 0  # appends of this daemon let through before the other daemon's write

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    @property
    def shared(self) -> bool:
        return self.store.shared

    async def append_exchange(self, conversation_id: str, entry: IndexEntry, **kwargs: Any) -> None:
        if self.passing:
            self.passing -= 1
        else:
            before, self.before = self.before, None
            if before is not None:
                await before()
        await self.store.append_exchange(conversation_id, entry, **kwargs)


def writer_on(database: Database, store: Any) -> ConversationWriter:
    cache = ConversationCache(store, PostgresResponses(database), capacity=100)
    return ConversationWriter(cache, PostgresSummaries(database), clock=time.time, default_ttl=None, max_fork_depth=8)


@pytest.fixture
async def databases(pg_url: str) -> AsyncIterator[tuple[Database, Database]]:
    first, second = Database(pg_url), Database(pg_url)
    await first.open()
    await second.open()
    try:
        yield first, second
    finally:
        await first.close()
        await second.close()


async def append_racing_a_turn(databases: tuple[Database, Database], root: Path, passing: int
                               ) -> tuple[dict[str, Any], ConversationWriter, ConversationWriter]:
    """Two exchanges appended by one daemon while the other commits a turn, just before this
    daemon's append number `passing` reaches the database."""
    here_db, there_db = databases
    racing = AnotherDaemonFirst(PostgresConversations(here_db))
    racing.passing = passing
    here, there = writer_on(here_db, racing), writer_on(there_db, PostgresConversations(there_db))
    await here.create(here.new_meta("c", system="be brief"))
    service = ConversationService(Settings(_env_file=None, var_dir=root), Router(), here.cache, here,
                                  PostgresBlobs(here_db))
    turn_there = IndexEntry(n=0, response_id="m-turn-there", ts="2026-01-01T00:00:00Z", model="m",
                            tokens_in=5, tokens_out=5)

    async def commit_there() -> None:
        memory = await there.cache.require("c")
        lines = [{"v": 1, "type": "user", "content": "hello", "conversation_id": "c"},
                 {"v": 1, "type": "assistant", "content": "hi", "model": "m", "conversation_id": "c"}]

        def counted(meta: ConversationMeta, entries: list[IndexEntry]) -> ConversationMeta:
            return meta.model_copy(update={"exchanges": meta.exchanges + len(entries)})

        async with memory.lock:
            await there.commit(memory, [NewExchange(turn_there, lines, Exchange(
                input=[message("user", "hello")], output=[message("assistant", "hi")]))], memory.meta.system, counted)

    racing.before = commit_there
    reply = await service.handle_append(ConversationAppend.model_validate({
        "conversation_id": "c", "exchanges": [{"inputs": ["one"], "reply": "1"}, {"inputs": ["two"], "reply": "2"}],
    }), EventContext.root())
    assert racing.before is None  # the other daemon's turn did land first
    records = await PostgresResponses(there_db).read_many(reply["response_ids"])
    assert [r.content if r else None for r in records] == ["1", "2"]
    return reply, here, there


async def test_an_append_racing_another_daemons_turn_lands_after_it(databases: tuple[Database, Database],
                                                                     short_tmp: Path) -> None:
    reply, here, there = await append_racing_a_turn(databases, short_tmp, passing=0)

    assert reply["exchanges"] == [2, 3]
    stored = await there.reader.entries("c")
    assert [(e.n, e.response_id) for e in stored] == [(1, "m-turn-there"), *zip([2, 3], reply["response_ids"])]
    # one chain of digests through both daemons' exchanges, as a client-held history is matched by
    assert all(e.digest for e in stored) and len({e.digest for e in stored}) == 3
    meta = await there.load_meta("c")
    assert meta is not None and meta.exchanges == 3
    memory = await here.cache.require("c")
    assert memory.total == 3 and memory.meta.exchanges == 3


async def test_an_append_whose_second_exchange_loses_the_race_stores_each_once(
        databases: tuple[Database, Database], short_tmp: Path) -> None:
    reply, here, there = await append_racing_a_turn(databases, short_tmp, passing=1)

    # the first was stored before the other daemon's turn; the second goes after it, never twice
    assert reply["exchanges"] == [1, 3]
    stored = await there.reader.entries("c")
    assert [e.response_id for e in stored] == [reply["response_ids"][0], "m-turn-there", reply["response_ids"][1]]
    assert all(e.digest for e in stored) and len({e.digest for e in stored}) == 3
    meta = await there.load_meta("c")
    assert meta is not None and meta.exchanges == 3
    memory = await here.cache.require("c")
    assert memory.total == 3 and [e.n for e in memory.entries] == [1, 2, 3]


async def reply_racing_another_daemon(databases: tuple[Database, Database], root: Path,
                                      there_does: Callable[[ConversationService], Awaitable[None]]
                                      ) -> tuple[ConversationService, ConversationWriter]:
    """A conversation holding pending input p1; this daemon appends the reply to it while the other
    daemon does `there_does` just before this daemon's append reaches the database."""
    here_db, there_db = databases
    racing = AnotherDaemonFirst(PostgresConversations(here_db))
    here, there = writer_on(here_db, racing), writer_on(there_db, PostgresConversations(there_db))
    await here.create(here.new_meta("c"))
    settings = Settings(_env_file=None, var_dir=root)
    service_here = ConversationService(settings, Router(), here.cache, here, PostgresBlobs(here_db))
    service_there = ConversationService(settings, Router(), there.cache, there, PostgresBlobs(there_db))
    await service_here.handle_pend(ConversationPend(conversation_id="c", inputs=["p1"]), EventContext.root())

    async def before() -> None:
        await there_does(service_there)

    racing.before = before
    return service_here, there


async def test_a_reply_to_pending_input_another_daemon_answered_meanwhile_is_refused(
        databases: tuple[Database, Database], short_tmp: Path) -> None:
    async def answer_p1(service: ConversationService) -> None:
        await service.handle_append(ConversationAppend(conversation_id="c", reply_to_pending="there"),
                                    EventContext.root())

    here, there = await reply_racing_another_daemon(databases, short_tmp, answer_p1)
    with pytest.raises(KsiError) as refused:
        await here.handle_append(ConversationAppend(conversation_id="c", reply_to_pending="here"),
                                 EventContext.root())
    assert refused.value.code == ErrorCode.HISTORY_MISMATCH
    # p1 answered once, by the other daemon; nothing of this daemon's reply stored
    stored = await there.reader.entries("c")
    assert len(stored) == 1
    [record] = await PostgresResponses(databases[1]).read_many([stored[0].response_id])
    assert record is not None and record.content == "there"
    meta = await there.load_meta("c")
    assert meta is not None and meta.exchanges == 1 and not pending_of(meta)


async def test_a_reply_to_pending_input_keeps_what_another_daemon_pended_meanwhile(
        databases: tuple[Database, Database], short_tmp: Path) -> None:
    async def pend_p2(service: ConversationService) -> None:
        await service.handle_pend(ConversationPend(conversation_id="c", inputs=["p2"]), EventContext.root())

    here, there = await reply_racing_another_daemon(databases, short_tmp, pend_p2)
    reply = await here.handle_append(ConversationAppend(conversation_id="c", reply_to_pending="r1"),
                                     EventContext.root())
    assert reply["exchanges"] == [1]
    meta = await there.load_meta("c")
    assert meta is not None and meta.exchanges == 1
    assert [entry.content for entry in pending_of(meta)] == ["p2"]  # still waiting for its reply
    [record] = await PostgresResponses(databases[1]).read_many(reply["response_ids"])
    assert record is not None and record.content == "r1" and [line["content"] for line in record.inputs] == ["p1"]
