"""Reading conversations stored in PostgreSQL: the read port (`StoredReader`) over the database.

The `ksi` inspection commands use it with the daemon stopped (their own small pool, made on first
use); the daemon's conversation store extends it and runs the same queries on the daemon's pool.
asyncpg is imported only here, and this module only when `KSI_STORAGE=postgres` is chosen.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import asyncpg
import orjson

from ksi_common.dburl import mask_urls_in
from ksi_common.errors import ErrorCode, KsiError
from ksi_common.layout import VarLayout
from ksi_common.records import INPUT_TYPES, IndexEntry, ResponseRecord
from ksi_common.summaries import Summary

T = TypeVar("T")
Run = Callable[[Callable[[asyncpg.Connection], Awaitable[T]]], Awaitable[T]]

ENTRY_COLUMNS = "n, response_id, ts, model, provider, agent_id, tokens_in, tokens_out, is_feedback, run_id, digest"


async def init_connection(conn: asyncpg.Connection) -> None:
    """JSON columns in and out as Python values through orjson (cheaper than the json module)."""
    for name in ("json", "jsonb"):
        await conn.set_type_codec(name, schema="pg_catalog", format="text",
                                  encoder=lambda v: orjson.dumps(v, default=str).decode(), decoder=orjson.loads)


def entry_of(row: asyncpg.Record) -> IndexEntry:
    return IndexEntry(
        n=row["n"], response_id=row["response_id"], ts=row["ts"], model=row["model"], provider=row["provider"],
        agent_id=row["agent_id"], tokens_in=row["tokens_in"], tokens_out=row["tokens_out"],
        is_feedback=row["is_feedback"], run_id=row["run_id"], digest=row["digest"],
    )


def response_of(response_id: str, lines: list[dict[str, Any]]) -> ResponseRecord:
    """A response record rebuilt from its lines, as the file reader does."""
    record = ResponseRecord(response_id=response_id)
    for line in lines:
        kind = line.get("type") if isinstance(line, dict) else None
        if kind in INPUT_TYPES:
            record.inputs.append(line)
        elif kind in ("assistant", "error"):
            record.outcome = line
    return record


def index_only_meta(conversation_id: str, exchanges: int, last_ts: str | None, models: list[str]) -> dict[str, Any]:
    """What is known of a conversation that has an index but no metadata (imported from an old var dir)."""
    return {"conversation_id": conversation_id, "exchanges": exchanges, "last_activity": last_ts, "models": models}


class PostgresReader:
    """The read port over the database; `run` executes work on a pooled connection."""

    def __init__(self, layout: VarLayout | None = None, database_url: str | None = None, *,
                 run: Run[Any] | None = None) -> None:
        if run is None and not database_url:
            raise ValueError("KSI_STORAGE=postgres needs KSI_DATABASE_URL")
        self._url = database_url
        self._own_pool: asyncpg.Pool | None = None
        self._run: Run[Any] = run or self._run_own

    async def _run_own(self, work: Callable[[asyncpg.Connection], Awaitable[T]]) -> T:
        """`work` on the reader's own pool; a database that cannot be read is a KsiError (the
        commands report it by its code), its URL's password masked."""
        try:
            if self._own_pool is None:
                self._own_pool = await asyncpg.create_pool(self._url, min_size=1, max_size=2, init=init_connection)
            async with self._own_pool.acquire() as conn:
                return await work(conn)
        except (OSError, asyncpg.InterfaceError) as error:  # refused, unresolvable, timed out, closed
            raise KsiError(ErrorCode.STORAGE_UNAVAILABLE,
                           f"cannot reach the database: {mask_urls_in(str(error))}") from None
        except asyncpg.PostgresError as error:  # a wrong password, no such database, no schema yet
            raise KsiError(ErrorCode.STORAGE_ERROR, f"cannot read the database: {mask_urls_in(str(error))}",
                           sqlstate=error.sqlstate) from None

    async def aclose(self) -> None:
        if self._own_pool is not None:
            pool, self._own_pool = self._own_pool, None
            await pool.close()

    async def conversation_ids(self) -> list[str]:
        rows = await self._run(lambda c: c.fetch("SELECT conversation_id FROM ksi_conversations ORDER BY 1"))
        return [r[0] for r in rows]

    async def metas(self, conversation_ids: list[str]) -> list[dict[str, Any] | None]:
        async def work(conn: asyncpg.Connection) -> list[asyncpg.Record]:
            return await conn.fetch(
                """
                SELECT c.conversation_id, c.meta, c.head,
                       CASE WHEN c.meta IS NULL THEN (
                           SELECT json_build_object('count', count(*), 'last_ts', max(e.ts),
                                                    'models', coalesce(json_agg(DISTINCT e.model)
                                                                       FILTER (WHERE e.model IS NOT NULL), '[]'))
                           FROM ksi_exchanges e WHERE e.conversation_id = c.conversation_id) END AS summary
                FROM ksi_conversations c WHERE c.conversation_id = ANY($1::text[])
                """, conversation_ids)

        found: dict[str, dict[str, Any]] = {}
        for row in await self._run(work):
            meta = row["meta"]
            if meta is None:
                summary = row["summary"]
                meta = index_only_meta(row["conversation_id"], summary["count"], summary["last_ts"], summary["models"])
            found[row["conversation_id"]] = meta
        return [found.get(c) for c in conversation_ids]

    async def all_metas(self) -> list[dict[str, Any]]:
        """Every conversation's metadata in one query (a listing filters these)."""
        return [m for m in await self.metas(await self.conversation_ids()) if m is not None]

    async def entries(self, conversation_id: str) -> list[IndexEntry]:
        rows = await self._run(lambda c: c.fetch(
            f"SELECT {ENTRY_COLUMNS} FROM ksi_exchanges WHERE conversation_id = $1 ORDER BY n", conversation_id))
        return [entry_of(r) for r in rows]

    async def responses(self, response_ids: list[str]) -> list[ResponseRecord | None]:
        if not response_ids:
            return []
        rows = await self._run(lambda c: c.fetch(
            "SELECT response_id, lines FROM ksi_responses WHERE response_id = ANY($1::text[])", response_ids))
        found = {r["response_id"]: response_of(r["response_id"], r["lines"]) for r in rows}
        return [found.get(r) for r in response_ids]

    async def summaries(self, conversation_id: str) -> list[Summary]:
        rows = await self._run(lambda c: c.fetch(
            "SELECT record FROM ksi_summaries WHERE conversation_id = $1 ORDER BY seq", conversation_id))
        return [s for r in rows if (s := Summary.from_record(r["record"])) is not None]

    async def forks_of(self, conversation_id: str) -> list[str]:
        rows = await self._run(lambda c: c.fetch(
            "SELECT conversation_id FROM ksi_conversations WHERE parent_id = $1 ORDER BY 1", conversation_id))
        return [r[0] for r in rows]

    async def agent_records(self) -> list[dict[str, Any]]:
        rows = await self._run(lambda c: c.fetch("SELECT record FROM ksi_agents ORDER BY agent_id"))
        return [r["record"] for r in rows if isinstance(r["record"], dict)]
