"""The requests every daemon of one database accepted: the `PoolRequests` port.

A request's row is written with its ticket, before its ack (leases.py). Its end is written from
the request journal's hot path, so it is queued and written in the background, in order; a lost
end (the daemon killed just after) leaves the row open, and the daemon taking it over finds the
exchange indexed and reports it done without running it again.

Taking over is one transaction: the open rows of daemons whose heartbeat is older than the
timeout become this daemon's, each with a new ticket at the end of its conversation's line (in
the order they were accepted: this daemon's queue of a conversation follows its tickets), any lease
their turns hold is revoked (its generation bumped, so the silent daemon, should it wake, cannot
commit). An append under way holds its lease row until it commits, so whether each request's
exchange is indexed is read after the revocation, in the same transaction, and is final.
"""

from __future__ import annotations

import asyncio
import contextlib

import asyncpg
import structlog

from ksi_common.errors import KsiError
from ksi_daemon.storage.ports import PoolRequest
from ksi_daemon.storage.postgres.database import Database

log = structlog.get_logger("ksi.storage.postgres")

KEEP_FINISHED = "1 day"  # ended requests answer `completion:status` from any daemon this long

COLUMNS = "request_id, conversation_id, daemon_id, status, response_id, record, code, accepted"

END = """
UPDATE ksi_requests SET status = $3, code = $4, finished = now()
WHERE request_id = $1 AND daemon_id = $2 AND finished IS NULL
"""

# open requests of daemons silent for $2 seconds; locked, skipping any another daemon is claiming
ORPHANS = """
SELECT r.request_id FROM ksi_requests r
WHERE r.finished IS NULL AND r.daemon_id <> $1
  AND NOT EXISTS (SELECT 1 FROM ksi_daemons d WHERE d.daemon_id = r.daemon_id
                  AND d.heartbeat > now() - make_interval(secs => $2))
FOR UPDATE SKIP LOCKED
"""

# checked again under the locks, on a fresh snapshot: one another daemon claimed meanwhile is its own
CLAIM = f"""
UPDATE ksi_requests r SET daemon_id = $1, taken_from = r.daemon_id
WHERE r.request_id = ANY($3::text[]) AND r.finished IS NULL AND r.daemon_id <> $1
  AND NOT EXISTS (SELECT 1 FROM ksi_daemons d WHERE d.daemon_id = r.daemon_id
                  AND d.heartbeat > now() - make_interval(secs => $2))
RETURNING {COLUMNS}
"""


def request_of(row: asyncpg.Record, indexed: bool = False) -> PoolRequest:
    return PoolRequest(request_id=row["request_id"], conversation_id=row["conversation_id"],
                       daemon_id=row["daemon_id"], status=row["status"], response_id=row["response_id"],
                       record=dict(row["record"]), code=row["code"], indexed=indexed)


class PostgresRequests:
    def __init__(self, database: Database, daemon_id: str) -> None:
        self.database = database
        self.daemon_id = daemon_id
        self._ends: asyncio.Queue[tuple[str, str, str | None]] = asyncio.Queue()
        self._writer: asyncio.Task[None] | None = None
        self.taken_over = 0

    def ended(self, request_id: str, status: str, code: str | None) -> None:
        self._ends.put_nowait((request_id, status, code))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._write_ends())

    async def _write_ends(self) -> None:
        while not self._ends.empty():
            ends = [self._ends.get_nowait() for _ in range(self._ends.qsize())]
            rows = [(request_id, self.daemon_id, status, code) for request_id, status, code in ends]
            try:
                await self.database.run(lambda c: c.executemany(END, rows))
            except KsiError as exc:  # left open: a takeover finds what became of them in the index
                log.warning("request_end_not_recorded", requests=len(rows), error=exc.message)

    async def flush(self) -> None:
        if self._writer is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer

    async def find(self, request_id: str) -> PoolRequest | None:
        row = await self.database.run(lambda c: c.fetchrow(
            f"SELECT {COLUMNS}, EXISTS (SELECT 1 FROM ksi_exchanges e WHERE e.conversation_id = r.conversation_id "
            "AND e.response_id = r.response_id) AS indexed FROM ksi_requests r WHERE request_id = $1", request_id))
        return request_of(row, bool(row["indexed"])) if row is not None else None

    async def ask_cancel(self, request_id: str) -> PoolRequest | None:
        row = await self.database.run(lambda c: c.fetchrow(
            f"UPDATE ksi_requests SET cancel_asked = finished IS NULL WHERE request_id = $1 RETURNING {COLUMNS}",
            request_id))
        return request_of(row) if row is not None else None

    async def cancels_asked(self) -> list[str]:
        rows = await self.database.run(lambda c: c.fetch(
            "SELECT request_id FROM ksi_requests WHERE daemon_id = $1 AND finished IS NULL AND cancel_asked",
            self.daemon_id))
        return [r["request_id"] for r in rows]

    async def take_over(self, stale_after: float) -> list[PoolRequest]:
        async def work(conn: asyncpg.Connection) -> list[PoolRequest]:
            async with conn.transaction():
                orphans = [r["request_id"] for r in await conn.fetch(ORPHANS, self.daemon_id, float(stale_after))]
                if not orphans:
                    return []
                claimed = await conn.fetch(CLAIM, self.daemon_id, float(stale_after), orphans)
                if not claimed:
                    return []
                ids = [r["request_id"] for r in claimed]
                # a new ticket each, at the end of its line: this daemon's queue follows its tickets
                await conn.execute("DELETE FROM ksi_turn_line WHERE request_id = ANY($1::text[])", ids)
                await conn.executemany(
                    "INSERT INTO ksi_turn_line (conversation_id, request_id, daemon_id) VALUES ($1, $2, $3)",
                    [(r["conversation_id"], r["request_id"], self.daemon_id)
                     for r in sorted(claimed, key=lambda r: r["accepted"])])
                await conn.execute("UPDATE ksi_leases SET generation = generation + 1, expires_at = '-infinity' "
                                   "WHERE request_id = ANY($1::text[])", ids)
                indexed = {r["response_id"] for r in await conn.fetch(
                    "SELECT e.response_id FROM ksi_exchanges e JOIN ksi_requests r "
                    "ON e.conversation_id = r.conversation_id AND e.response_id = r.response_id "
                    "WHERE r.request_id = ANY($1::text[])", ids)}
                return [request_of(r, r["response_id"] in indexed) for r in claimed]

        taken = await self.database.run(work, retry=False)
        self.taken_over += len(taken)
        await self.database.run(lambda c: c.execute(
            f"DELETE FROM ksi_requests WHERE finished < now() - interval '{KEEP_FINISHED}'"))
        return taken
