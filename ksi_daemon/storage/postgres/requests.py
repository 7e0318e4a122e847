"""The requests every daemon of one database accepted: the `PoolRequests` port.

A request's row is written with its ticket, before its ack (leases.py). Its end is written from
the request journal's hot path, so it is queued and written in the background, in order; a lost
end (the daemon killed just after) leaves the row open, and the daemon taking it over finds the
exchange indexed and reports it done without running it again.

Taking over is one transaction: the open rows of daemons whose heartbeat is older than the
timeout become this daemon's, each keeping its ticket, so its place in its conversation's line
(this daemon's queue of a conversation follows its tickets), any lease their turns hold is revoked
(its generation bumped, so the silent daemon, should it wake, cannot commit). An append under way
holds its lease row until it commits, so whether each request's exchange is indexed is read after
the revocation, in the same transaction, and is final.

Offers and claims: a daemon whose turn holds its conversation's lease but waits for a call slot offers
it (`offered`, and a notification on `WORK_CHANNEL`); a daemon with a free slot claims the oldest
offer, in one statement that locks the row (`FOR UPDATE SKIP LOCKED`: two claimers never wait for
each other), moves the request and its ticket to itself, revokes the lease the offering daemon held
for it and tells it (`taken <request id> <claimer>`). The offering daemon takes its offer back before it runs
the turn, on the same row: whichever comes first wins, and the other learns it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence

import asyncpg
import structlog

from ksi_common.errors import KsiError
from ksi_daemon.storage.ports import PoolRequest
from ksi_daemon.storage.postgres.database import Database
from ksi_daemon.storage.postgres.relay import PostgresRelay

log = structlog.get_logger("ksi.storage.postgres")

WITHDRAW_RETRY = 0.5  # seconds between two tries (an offer taken back, ends written) while the database is away
ENDS_RETRY_FOR = 120.0  # seconds requests' ends are tried again before they are left open
FLUSH_WAIT = 5.0  # seconds a stop waits for the ends still being written
KEEP_FINISHED = "1 day"  # ended requests answer `completion:status` from any daemon this long

COLUMNS = "request_id, conversation_id, daemon_id, status, response_id, record, code, accepted"

WORK_CHANNEL = "ksi_work"

OFFER = f"""
WITH offered AS (
    UPDATE ksi_requests SET offered = true WHERE request_id = $1 AND daemon_id = $2 AND finished IS NULL
    RETURNING 1
),
notified AS (SELECT pg_notify('{WORK_CHANNEL}', 'offered ') FROM offered)
SELECT count(*) FROM notified
"""

WITHDRAW = "UPDATE ksi_requests SET offered = false WHERE request_id = $1 AND daemon_id = $2 RETURNING 1"

# the oldest offer by its place in line; the lease revoked is left naming no request, so the ticket
# is not taken for one whose lease ran out (it keeps its place at the head)
CLAIM_OFFERED = f"""
WITH pick AS (
    SELECT r.request_id FROM ksi_requests r JOIN ksi_turn_line t ON t.request_id = r.request_id
    WHERE r.offered AND r.finished IS NULL AND r.daemon_id <> $1 AND NOT (r.record->>'model' = ANY($2::text[]))
    ORDER BY t.ticket LIMIT 1 FOR UPDATE OF r SKIP LOCKED
),
taken AS (
    UPDATE ksi_requests r SET daemon_id = $1, taken_from = r.daemon_id, offered = false
    FROM pick WHERE r.request_id = pick.request_id AND r.offered AND r.finished IS NULL
    RETURNING r.request_id, r.conversation_id, r.daemon_id, r.status, r.response_id, r.record, r.code
),
moved AS (UPDATE ksi_turn_line t SET daemon_id = $1 FROM taken WHERE t.request_id = taken.request_id),
revoked AS (
    UPDATE ksi_leases l SET generation = l.generation + 1, expires_at = '-infinity', request_id = ''
    FROM taken WHERE l.request_id = taken.request_id
)
SELECT taken.*, pg_notify('{WORK_CHANNEL}', 'taken ' || taken.request_id || ' ' || $1) FROM taken
"""

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
UPDATE ksi_requests r SET daemon_id = $1, taken_from = r.daemon_id, offered = false
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
    def __init__(self, database: Database, daemon_id: str, relay: PostgresRelay) -> None:
        self.database = database
        self.daemon_id = daemon_id
        self.relay = relay  # its listening connection hears the offers and claims
        self.stolen = 0  # requests this daemon claimed from daemons at their limits
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
            # tried again while the database is away (it restarts): an end left unwritten keeps the
            # request open, so a client waiting on another daemon would wait for it in vain
            deadline = time.monotonic() + ENDS_RETRY_FOR
            while True:
                try:
                    await self.database.run(lambda c: c.executemany(END, rows))
                    break
                except KsiError as exc:
                    if time.monotonic() > deadline:  # left open: a takeover finds what became of them
                        log.warning("request_end_not_recorded", requests=len(rows), error=exc.message)
                        break
                    await asyncio.sleep(WITHDRAW_RETRY)

    async def flush(self, timeout: float = FLUSH_WAIT) -> None:
        if self._writer is not None and not self._writer.done():
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._writer), timeout)

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
                # each keeps its ticket, so its place in line: this daemon's queue follows its tickets
                await conn.execute("UPDATE ksi_turn_line SET daemon_id = $1 WHERE request_id = ANY($2::text[])",
                                   self.daemon_id, ids)
                await conn.execute("UPDATE ksi_leases SET generation = generation + 1, expires_at = '-infinity', "
                                   "request_id = '' WHERE request_id = ANY($1::text[])", ids)
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

    async def offer(self, request_id: str) -> bool:
        try:
            return bool(await self.database.run(lambda c: c.fetchval(OFFER, request_id, self.daemon_id)))
        except KsiError as exc:
            # the update may have committed before the error reached here, and a claim after it: taken
            # back, it waits for a slot here; not taken back, it was claimed and waits as an offer does
            log.warning("offer_failed", request_id=request_id, error=exc.message)
            return not await self.withdraw(request_id)

    async def withdraw(self, request_id: str) -> bool:
        while True:
            try:
                return await self.database.run(lambda c: c.fetchval(WITHDRAW, request_id, self.daemon_id)) is not None
            except KsiError as exc:  # not knowing whether it was claimed, it must not run: ask again
                log.warning("withdraw_failed", request_id=request_id, error=exc.message)
                await asyncio.sleep(WITHDRAW_RETRY)

    async def claim_offered(self, skip_models: Sequence[str] = ()) -> PoolRequest | None:
        row = await self.database.run(lambda c: c.fetchrow(CLAIM_OFFERED, self.daemon_id, list(skip_models)),
                                      retry=False)
        if row is None:
            return None
        self.stolen += 1
        return request_of(row)

    def watch(self, heard: Callable[[str, str], None]) -> None:
        def on_notification(_conn: object, _pid: int, _channel: str, payload: str) -> None:
            news, request_id, claimer = (payload.split(" ") + ["", ""])[:3]
            if news != "taken" or claimer != self.daemon_id:  # this daemon's own claims say nothing to it
                heard(news, request_id)

        self.relay.listen_also(WORK_CHANNEL, on_notification)
