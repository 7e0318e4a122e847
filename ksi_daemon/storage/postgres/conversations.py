"""Conversations in PostgreSQL: metadata rows and the exchange index; the `ConversationStore` port.

Several daemons write the same conversations. The conditional append is one statement: it moves
the conversation's `head` to n only where `head < n` (the row lock makes a second writer of n
wait, then find the head moved) and inserts the exchange row only if the head moved; the
(conversation_id, n) primary key is the backstop. A retry of an append whose first attempt did
commit (its connection died before the answer) finds its own response id at n and succeeds.

An append made while this daemon holds the conversation's lease (a turn) is fenced in the same
statement: it writes nothing unless the lease row still carries the generation granted, and it
locks that row until it commits (see leases.py). Refused, it raises `lease_lost`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import asyncpg
import structlog

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.postgres_reader import ENTRY_COLUMNS, PostgresReader, entry_of
from ksi_common.records import IndexEntry
from ksi_daemon.storage.models import ConversationMeta
from ksi_daemon.storage.ports import ConversationExists, DigestMatch, ExchangeConflict, StoredTail
from ksi_daemon.storage.postgres.database import Database

log = structlog.get_logger("ksi.storage.postgres")

APPEND_WAIT = 60.0  # seconds an exchange's append waits for a database that went away
APPEND_RETRY = 0.5  # seconds between two tries meanwhile

APPEND = """
WITH fence AS (
    SELECT 1 FROM ksi_leases WHERE conversation_id = $1 AND generation = $18::bigint FOR SHARE
),
response AS (
    INSERT INTO ksi_responses (response_id, conversation_id, lines)
    SELECT $2, $1, $12::json WHERE $12::json IS NOT NULL AND ($18::bigint IS NULL OR EXISTS (SELECT 1 FROM fence))
    ON CONFLICT (response_id) DO NOTHING
),
moved AS (
    UPDATE ksi_conversations
    SET head = $3, tokens = tokens + $13, version = version + 1,
        meta = coalesce($14::json, meta), last_activity = coalesce($15, last_activity)
    WHERE conversation_id = $1 AND head < $3 AND ($16::bigint IS NULL OR $14::json IS NULL OR version = $16)
      AND ($18::bigint IS NULL OR EXISTS (SELECT 1 FROM fence))
    RETURNING tokens - $13 AS before, version
),
inserted AS (
    INSERT INTO ksi_exchanges (conversation_id, n, response_id, ts, model, provider, agent_id,
                               tokens_in, tokens_out, is_feedback, run_id, tokens_before, digest)
    SELECT $1, $3, $2, $4, $5, $6, $7, $8, $9, $10, $11, moved.before, $17 FROM moved
    RETURNING n
)
SELECT moved.version FROM moved, inserted
"""

EXCHANGE_COLUMNS = ", ".join("e." + c.strip() for c in ENTRY_COLUMNS.split(","))  # an index entry's, from ksi_exchanges e

# the newest non-feedback exchanges whose tokens fit the budget: `tokens_before` is the running
# sum of eligible tokens before each exchange, so they are those with tokens_before >= total - budget
TAIL = f"""
SELECT c.head, {EXCHANGE_COLUMNS}
FROM ksi_conversations c
LEFT JOIN ksi_exchanges e
  ON e.conversation_id = c.conversation_id AND e.tokens_before >= c.tokens - $2 AND NOT e.is_feedback
WHERE c.conversation_id = $1
ORDER BY e.n
"""

# the head, and only when it is not the one the caller holds or another daemon wrote the metadata
# since this one last read or wrote it (version $4; NULL: not known), the metadata and the tail as
# TAIL reads it
MOVED_TAIL = f"""
SELECT c.head, c.version, CASE WHEN c.head <> $2 OR c.version <> $4 THEN c.meta END AS meta,
       {EXCHANGE_COLUMNS}
FROM ksi_conversations c
LEFT JOIN ksi_exchanges e
  ON (c.head <> $2 OR c.version <> $4) AND e.conversation_id = c.conversation_id
     AND e.tokens_before >= c.tokens - $3 AND NOT e.is_feedback
WHERE c.conversation_id = $1
ORDER BY e.n
"""

UPSERT_META = """
INSERT INTO ksi_conversations (conversation_id, meta, base, parent_id, last_activity)
VALUES ($1, $2::json, $3, $4, $5)
ON CONFLICT (conversation_id) DO UPDATE
SET meta = EXCLUDED.meta, base = EXCLUDED.base, parent_id = EXCLUDED.parent_id,
    last_activity = EXCLUDED.last_activity, version = ksi_conversations.version + 1
RETURNING version
"""

CREATE = """
INSERT INTO ksi_conversations (conversation_id, meta, base, parent_id, last_activity)
VALUES ($1, $2::json, $3, $4, $5)
ON CONFLICT (conversation_id) DO NOTHING
RETURNING version
"""


def meta_columns(meta: ConversationMeta) -> tuple[Any, ...]:
    """The row values of a metadata document: the document and the columns queries filter on."""
    base = (meta.fork_at or 0) if meta.parent_id else 0
    return meta.conversation_id, meta.model_dump(mode="json"), base, meta.parent_id, meta.last_activity


def eligible_tokens(entry: IndexEntry) -> int:
    return 0 if entry.is_feedback else entry.tokens_in + entry.tokens_out


def layout_names(conversation_id: str, response_ids: list[str], index: bool, meta: bool,
                 summaries: bool = False) -> list[str]:
    """Removed items named as the var-dir layout names them (what `migrate --to jsonl` would write)."""
    names = [f"logs/responses/{r}.jsonl" for r in response_ids]
    if index:
        names.append(f"logs/conversations/{conversation_id}.jsonl")
    if summaries:
        names.append(f"logs/summaries/{conversation_id}.jsonl")
    if meta:
        names.append(f"state/conversations/{conversation_id}.json")
    return sorted(names)


class PostgresConversations(PostgresReader):
    """The conversation store over the daemon's pool; reads are the inspection commands' reads."""

    def __init__(self, database: Database, fence: Callable[[str], int | None] = lambda _conversation_id: None) -> None:
        super().__init__(run=database.run)
        self.database = database
        self.fence = fence  # the lease generation this daemon holds on a conversation (leases.py)
        # the metadata version this daemon last read or wrote, per conversation: an exchange's
        # metadata is written only over that version, so a change another daemon made since (a
        # title, a status, its own exchange) makes the append a conflict and the caller reloads
        self._versions: dict[str, int] = {}

    @property
    def shared(self) -> bool:
        return True  # other daemons may write the same conversations: caches check the head

    async def exists(self, conversation_id: str) -> bool:
        return bool(await self.database.run(lambda c: c.fetchval(
            "SELECT EXISTS (SELECT 1 FROM ksi_conversations WHERE conversation_id = $1)", conversation_id)))

    async def create(self, meta: ConversationMeta, *, durable_with_first_exchange: bool = False) -> None:
        # a committed transaction is durable either way
        created = await self.database.run(lambda c: c.fetchval(CREATE, *meta_columns(meta)), retry=False)
        if created is None:
            raise ConversationExists(meta.conversation_id)
        self._versions[meta.conversation_id] = created

    async def load_meta(self, conversation_id: str) -> ConversationMeta | None:
        row = await self.database.run(lambda c: c.fetchrow(
            "SELECT meta, version FROM ksi_conversations WHERE conversation_id = $1", conversation_id))
        if row is None:
            self._versions.pop(conversation_id, None)
            return None
        self._versions[conversation_id] = row["version"]
        if row["meta"] is None:
            return ConversationMeta(conversation_id=conversation_id)  # an index without metadata
        return ConversationMeta.model_validate(row["meta"])

    async def save_meta(self, meta: ConversationMeta) -> None:
        self._versions[meta.conversation_id] = await self.database.run(
            lambda c: c.fetchval(UPSERT_META, *meta_columns(meta)))

    async def head(self, conversation_id: str) -> int:
        head = await self.database.run(lambda c: c.fetchval(
            "SELECT head FROM ksi_conversations WHERE conversation_id = $1", conversation_id))
        return int(head or 0)

    async def moved_since(self, conversation_id: str, head: int, token_budget: int) -> StoredTail | None:
        known = self._versions.get(conversation_id)
        rows = await self.database.run(lambda c: c.fetch(MOVED_TAIL, conversation_id, head, token_budget, known))
        if not rows:
            self._versions.pop(conversation_id, None)
            return StoredTail(None, [], 0)
        first = rows[0]
        # metadata another daemon wrote (input it pended, a title, an archive) is read as a move is:
        # matched on stale metadata, a turn would neither take that input nor keep what it says
        if first["head"] == head and (known is None or first["version"] == known):
            return None
        self._versions[conversation_id] = first["version"]
        raw = first["meta"]
        meta = (ConversationMeta.model_validate(raw) if raw is not None
                else ConversationMeta(conversation_id=conversation_id))  # an index without metadata
        return StoredTail(meta, [entry_of(r) for r in rows if r["n"] is not None], int(first["head"]))

    async def append_exchange(self, conversation_id: str, entry: IndexEntry, *,
                              response: list[dict[str, Any]] | None = None,
                              meta: ConversationMeta | None = None) -> None:
        values = (
            conversation_id, entry.response_id, entry.n, entry.ts, entry.model, entry.provider, entry.agent_id,
            entry.tokens_in, entry.tokens_out, entry.is_feedback, entry.run_id, response, eligible_tokens(entry),
            meta.model_dump(mode="json") if meta is not None else None, meta.last_activity if meta else None,
            self._versions.get(conversation_id), entry.digest,
        )
        fence = self.fence(conversation_id)

        async def work(conn: asyncpg.Connection) -> None:
            try:
                version = await conn.fetchval(APPEND, *values, fence)
            except asyncpg.UniqueViolationError:
                version = None
            if version is not None:
                self._versions[conversation_id] = version
                return
            row = await conn.fetchrow(
                """
                SELECT c.head, (SELECT n FROM ksi_exchanges e
                                WHERE e.conversation_id = $1 AND e.response_id = $2) AS mine,
                       (SELECT generation FROM ksi_leases l WHERE l.conversation_id = $1) AS generation
                FROM ksi_conversations c WHERE c.conversation_id = $1
                """, conversation_id, entry.response_id)
            if row is None:  # no conversation row yet (an index written without metadata first)
                await conn.execute(CREATE, conversation_id, None, 0, None, None)
                version = await conn.fetchval(APPEND, *values[:-2], None, entry.digest, fence)
                if version is not None:
                    self._versions[conversation_id] = version
                    return
                row = await conn.fetchrow(
                    "SELECT head, NULL AS mine, (SELECT generation FROM ksi_leases WHERE conversation_id = $1) "
                    "AS generation FROM ksi_conversations WHERE conversation_id = $1", conversation_id)
            if row["mine"] is not None:
                return  # an earlier attempt of this same append committed before its answer was lost
            if fence is not None and row["generation"] != fence:
                # paused past the lease: another daemon has the turn now, and may have moved the history
                raise KsiError(ErrorCode.LEASE_LOST,
                               f"this daemon lost its turn on conversation {conversation_id} to another daemon "
                               "before it could store the answer; the answer was not stored",
                               conversation_id=conversation_id)
            # exchange n is taken, or the metadata changed since this daemon read it: either way
            # the caller reloads (head and metadata) and appends again
            raise ExchangeConflict(conversation_id, entry.n, int(row["head"]))

        # an answer already made is stored when the database is back (it restarts), not dropped:
        # `work` is safe to repeat (an attempt that committed before its reply was lost is found)
        deadline = time.monotonic() + APPEND_WAIT
        while True:
            try:
                await self.database.run(work)
                return
            except KsiError as exc:
                if exc.code != ErrorCode.STORAGE_UNAVAILABLE or time.monotonic() > deadline:
                    raise
                log.warning("append_waits_for_database", conversation_id=conversation_id, error=exc.message)
                await asyncio.sleep(APPEND_RETRY)

    async def read_tail(self, conversation_id: str, token_budget: int) -> tuple[list[IndexEntry], int]:
        rows = await self.database.run(lambda c: c.fetch(TAIL, conversation_id, token_budget))
        if not rows:
            return [], 0
        return [entry_of(r) for r in rows if r["n"] is not None], int(rows[0]["head"])

    async def find_digest(self, digest: str) -> list[DigestMatch]:
        rows = await self.database.run(lambda c: c.fetch(
            "SELECT conversation_id, n FROM ksi_exchanges WHERE digest = $1", digest))
        return [DigestMatch(r["conversation_id"], r["n"]) for r in rows]

    async def move(self, conversation_id: str, new_id: str, note: dict[str, Any]) -> list[str]:
        async def work(conn: asyncpg.Connection) -> list[str]:
            async with conn.transaction():
                row = await conn.fetchrow(
                    "SELECT meta, head, tokens FROM ksi_conversations WHERE conversation_id = $1 FOR UPDATE",
                    conversation_id)
                raw = row["meta"] if row is not None else None
                meta = ConversationMeta.model_validate(raw) if raw else ConversationMeta(conversation_id=conversation_id)
                meta.conversation_id = new_id
                meta.extra.update(note)
                if await conn.fetchval(CREATE, *meta_columns(meta)) is None:
                    raise ConversationExists(new_id)
                if row is not None:
                    await conn.execute("UPDATE ksi_conversations SET head = $2, tokens = $3 WHERE conversation_id = $1",
                                       new_id, row["head"], row["tokens"])
                for table in ("ksi_exchanges", "ksi_summaries"):  # the index and its summaries move together
                    await conn.execute(f"UPDATE {table} SET conversation_id = $2 WHERE conversation_id = $1",
                                       conversation_id, new_id)
                await conn.execute("DELETE FROM ksi_conversations WHERE conversation_id = $1", conversation_id)
                forks = await conn.fetch(
                    "SELECT conversation_id, meta FROM ksi_conversations WHERE parent_id = $1 ORDER BY 1 FOR UPDATE",
                    conversation_id)
                for fork in forks:
                    fork_meta = ConversationMeta.model_validate(fork["meta"])
                    fork_meta.parent_id = new_id
                    await conn.execute(UPSERT_META, *meta_columns(fork_meta))
                return [f["conversation_id"] for f in forks]

        self._versions.pop(conversation_id, None)
        self._versions.pop(new_id, None)
        return await self.database.run(work, retry=False)

    async def adopt(self, conversation_id: str, source_id: str, meta: ConversationMeta, replaced: int = 0) -> bool:
        async def work(conn: asyncpg.Connection) -> bool:
            async with conn.transaction():
                target = await conn.fetchrow(
                    "SELECT head FROM ksi_conversations WHERE conversation_id = $1 FOR UPDATE", conversation_id)
                source = await conn.fetchrow(
                    "SELECT head, tokens FROM ksi_conversations WHERE conversation_id = $1 FOR UPDATE", source_id)
                if target is None or source is None or target["head"] != replaced or await conn.fetchval(
                        "SELECT count(*) FROM ksi_exchanges WHERE conversation_id = $1", conversation_id) != replaced:
                    return False
                for table in ("ksi_exchanges", "ksi_summaries"):  # the index and its summaries move together
                    await conn.execute(f"DELETE FROM {table} WHERE conversation_id = $1", conversation_id)
                    await conn.execute(f"UPDATE {table} SET conversation_id = $2 WHERE conversation_id = $1",
                                       source_id, conversation_id)
                await self._repoint_responses(conn, source_id, conversation_id)
                await conn.execute(UPSERT_META, *meta_columns(meta))
                await conn.execute("UPDATE ksi_conversations SET head = $2, tokens = $3 WHERE conversation_id = $1",
                                   conversation_id, source["head"], source["tokens"])
                await conn.execute("DELETE FROM ksi_conversations WHERE conversation_id = $1", source_id)
                return True

        self._versions.pop(conversation_id, None)
        self._versions.pop(source_id, None)
        return bool(await self.database.run(work, retry=False))

    @staticmethod
    async def _repoint_responses(conn: asyncpg.Connection, source_id: str, conversation_id: str) -> None:
        """The source's response records, their lines naming `conversation_id` instead."""
        rows = await conn.fetch("SELECT response_id, lines FROM ksi_responses WHERE conversation_id = $1", source_id)
        for row in rows:
            lines = [{**line, "conversation_id": conversation_id}
                     if isinstance(line, dict) and line.get("conversation_id") == source_id else line
                     for line in row["lines"]]
            await conn.execute("UPDATE ksi_responses SET conversation_id = $2, lines = $3::json WHERE response_id = $1",
                               row["response_id"], conversation_id, lines)

    async def discard_unused(self, conversation_id: str) -> bool:
        gone = await self.database.run(lambda c: c.fetchval(
            "DELETE FROM ksi_conversations WHERE conversation_id = $1 AND head = 0 AND NOT EXISTS "
            "(SELECT 1 FROM ksi_exchanges WHERE conversation_id = $1) RETURNING 1", conversation_id), retry=False)
        if gone:
            self._versions.pop(conversation_id, None)
        return bool(gone)

    async def delete(self, conversation_id: str) -> list[str]:
        async def work(conn: asyncpg.Connection) -> list[str]:
            async with conn.transaction():
                # a response record belongs to the conversation whose index lists it; its lines keep
                # the id they were written under, which after an agent reset names another one
                response_ids = [r[0] for r in await conn.fetch(
                    """
                    DELETE FROM ksi_responses r
                    WHERE (r.conversation_id = $1
                           OR r.response_id IN (SELECT response_id FROM ksi_exchanges WHERE conversation_id = $1))
                      AND NOT EXISTS (SELECT 1 FROM ksi_exchanges e
                                      WHERE e.response_id = r.response_id AND e.conversation_id <> $1)
                    RETURNING r.response_id
                    """, conversation_id)]
                indexed = await conn.fetchval(
                    "WITH gone AS (DELETE FROM ksi_exchanges WHERE conversation_id = $1 RETURNING 1) "
                    "SELECT count(*) FROM gone", conversation_id)
                summarized = await conn.fetchval(
                    "WITH gone AS (DELETE FROM ksi_summaries WHERE conversation_id = $1 RETURNING 1) "
                    "SELECT count(*) FROM gone", conversation_id)
                had_meta = await conn.fetchval(
                    "DELETE FROM ksi_conversations WHERE conversation_id = $1 RETURNING meta IS NOT NULL",
                    conversation_id)
                return layout_names(conversation_id, response_ids, bool(indexed), bool(had_meta), bool(summarized))

        self._versions.pop(conversation_id, None)
        return await self.database.run(work, retry=False)

    async def import_conversation(self, meta: ConversationMeta,
                                  exchanges: list[tuple[IndexEntry, list[dict[str, Any]]]]) -> None:
        async def work(conn: asyncpg.Connection) -> None:
            async with conn.transaction():
                if await conn.fetchval(CREATE, *meta_columns(meta)) is None:
                    raise ConversationExists(meta.conversation_id)
                await self.insert_exchanges(conn, meta.conversation_id, exchanges, head=0, tokens=0)

        await self.database.run(work, retry=False)

    @staticmethod
    async def insert_exchanges(conn: asyncpg.Connection, conversation_id: str,
                               exchanges: list[tuple[IndexEntry, list[dict[str, Any]] | None]],
                               head: int, tokens: int) -> None:
        """Append whole exchanges after `head` (whose running token sum is `tokens`), in one go."""
        responses = [(e.response_id, conversation_id, lines) for e, lines in exchanges if lines is not None]
        if responses:
            await conn.executemany(
                "INSERT INTO ksi_responses (response_id, conversation_id, lines) VALUES ($1, $2, $3::json) "
                "ON CONFLICT (response_id) DO NOTHING", responses)
        rows = []
        for entry, _lines in exchanges:
            rows.append((conversation_id, entry.n, entry.response_id, entry.ts, entry.model, entry.provider,
                         entry.agent_id, entry.tokens_in, entry.tokens_out, entry.is_feedback, entry.run_id, tokens,
                         entry.digest))
            tokens += eligible_tokens(entry)
            head = max(head, entry.n)
        if rows:
            await conn.copy_records_to_table(
                "ksi_exchanges", records=rows,
                columns=["conversation_id", "n", "response_id", "ts", "model", "provider", "agent_id",
                         "tokens_in", "tokens_out", "is_feedback", "run_id", "tokens_before", "digest"])
        await conn.execute("UPDATE ksi_conversations SET head = $2, tokens = $3 WHERE conversation_id = $1",
                           conversation_id, head, tokens)

