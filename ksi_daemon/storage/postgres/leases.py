"""One turn at a time per conversation across the daemons of one database: the `ConversationLeases` port.

A lease is a row (`ksi_leases`), not an advisory lock. A session advisory lock is held by a
connection, and a daemon paused with SIGSTOP keeps its connection open: the lock would outlive the
pause however long it lasts, and the conversation would stall. A transaction-level advisory lock
would keep a pooled connection in an open transaction for the whole model call (minutes, for some
models). A row with `expires_at = now() + lease`, by the database's clock (the hosts' clocks are
never compared), is renewed every third of the lease while the turn runs; a daemon paused or cut
off for longer loses it, and another daemon takes the turn.

Fencing: each grant bumps the row's `generation`, which never goes back (rows are never deleted).
The conversation store appends an exchange only while the generation this daemon was granted is
still the row's (`fence`), in the append's own statement, which locks the lease row for its
transaction: a daemon that resumes after losing its lease cannot commit, and a daemon taking the
lease waits for an append under way to commit, then reads the history with it.

Order: a turn takes a ticket (`ksi_turn_line`) when it is accepted, in the same statement that
records the whole request (`ksi_requests`). The lease goes to a turn only when no open request of
the conversation holds an earlier ticket, and only to the daemon the ticket belongs to; a daemon's
own turns of a conversation wait in its queue in the order of their tickets. A request taken over
(its daemon went silent) or claimed (its daemon was at its limits) keeps its ticket, so its place:
the ticket moves to the daemon that runs it, and that daemon's later turn waiting for the lease
steps back for it, or gives back a lease it holds but has not used yet, keeping its ticket
(`let_ahead`). Skipped are the tickets of requests that ended (their tickets' removal may have
failed) and the ticket of a turn whose lease ran out (its daemon is paused: it gives up its place
at the head until it is taken over). A waiter asks again every `POLL` seconds, and at once when a
turn of this daemon ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import structlog

from ksi_common.errors import KsiError
from ksi_daemon.background import stop_task
from ksi_daemon.storage.postgres.database import Database

log = structlog.get_logger("ksi.storage.postgres")

POLL = 0.05  # seconds between two asks of a waiting turn
RETRY = 0.5  # seconds before asking again when the database is away

# the ticket and the whole request, in one statement: the request is durable for the pool before its
# ack; a request taken over or claimed already has both, and keeps its ticket
LINE_UP = """
WITH request AS (
    INSERT INTO ksi_requests (request_id, conversation_id, daemon_id, status, response_id, record)
    VALUES ($2, $1, $3, 'queued', $4, $5::json) ON CONFLICT DO NOTHING
)
INSERT INTO ksi_turn_line (conversation_id, request_id, daemon_id) VALUES ($1, $2, $3)
ON CONFLICT (request_id) DO UPDATE SET daemon_id = EXCLUDED.daemon_id RETURNING ticket
"""

# $1 conversation, $2 request, $3 this daemon, $4 lease seconds. The head is the earliest ticket of
# an open request (a dead daemon's too: it is taken over with its ticket), this daemon's own included
# (its queue of the conversation is in ticket order, and a turn it has just claimed must not be
# overtaken by its own later one), but for the turn whose lease ran out (its daemon is paused)
ACQUIRE = """
WITH head AS (
    SELECT t.request_id, t.daemon_id FROM ksi_turn_line t
    JOIN ksi_requests r ON r.request_id = t.request_id AND r.finished IS NULL
    LEFT JOIN ksi_leases l ON l.conversation_id = t.conversation_id
    WHERE t.conversation_id = $1
      AND NOT coalesce(l.request_id = t.request_id AND l.expires_at < now() AND t.request_id <> $2, false)
    ORDER BY t.ticket LIMIT 1
),
granted AS (
    INSERT INTO ksi_leases AS l (conversation_id, request_id, daemon_id, generation, expires_at)
    SELECT $1, $2, $3, 1, now() + make_interval(secs => $4) FROM head WHERE head.request_id = $2 AND head.daemon_id = $3
    ON CONFLICT (conversation_id) DO UPDATE
    SET request_id = EXCLUDED.request_id, daemon_id = EXCLUDED.daemon_id, generation = l.generation + 1,
        expires_at = EXCLUDED.expires_at
    WHERE l.expires_at < now()
    RETURNING l.generation
)
SELECT (SELECT generation FROM granted) AS generation,
       EXISTS (SELECT 1 FROM ksi_turn_line WHERE request_id = $2 AND daemon_id = $3) AS mine
"""

RENEW = """
UPDATE ksi_leases SET expires_at = now() + make_interval(secs => $3)
WHERE conversation_id = $1 AND generation = $2 RETURNING 1
"""

# the ticket only while it is this daemon's: a request claimed by another daemon keeps it there
RELEASE = """
WITH gone AS (DELETE FROM ksi_turn_line WHERE request_id = $2 AND daemon_id = $4)
UPDATE ksi_leases SET expires_at = '-infinity' WHERE conversation_id = $1 AND generation = $3
"""

# turns accepted on any daemon that have not ended (a dead daemon's too: they are taken over)
IN_LINE = """
SELECT count(*) FROM ksi_turn_line t JOIN ksi_requests r ON r.request_id = t.request_id AND r.finished IS NULL
WHERE t.conversation_id = $1
"""

# held until the transaction ends, released by the server if the session dies with it
EXCLUSIVE = "SELECT pg_advisory_xact_lock(hashtextextended('ksi.exclusive:' || $1, 0))"

LEAVE = "DELETE FROM ksi_turn_line WHERE request_id = $1 AND daemon_id = $2"

GIVE_BACK = "UPDATE ksi_leases SET expires_at = '-infinity' WHERE conversation_id = $1 AND generation = $2"


class PostgresLeases:
    def __init__(self, database: Database, daemon_id: str, lease: float) -> None:
        self.database = database
        self.daemon_id = daemon_id
        self.lease = lease
        self._held: dict[str, int] = {}  # conversation -> the generation this daemon holds
        self._lined: set[str] = set()  # requests of this daemon waiting in a line
        self._retrying: set[asyncio.Task[None]] = set()  # releases tried again while the database is away
        self._asking: set[str] = set()  # requests asking for their lease right now
        self._granted: set[str] = set()  # requests holding their lease, running or about to
        self._keeping_place: set[str] = set()  # granted, then let an earlier turn go first: the ticket stays
        self._stepping_back: set[str] = set()  # waiters to stop asking: an earlier turn joined their queue
        self._turn_ended: dict[str, asyncio.Event] = {}  # conversation -> set when a turn here ends
        self.waits = 0  # asks that found the lease taken (what polling costs)

    def fence(self, conversation_id: str) -> int | None:
        """The lease generation an append to the conversation must still find; None: no turn held."""
        return self._held.get(conversation_id)

    async def line_up(self, conversation_id: str, request_id: str, record: dict[str, Any]) -> int:
        self._lined.add(request_id)
        try:
            return int(await self.database.run(lambda c: c.fetchval(
                LINE_UP, conversation_id, request_id, self.daemon_id, record.get("response_id"), record)))
        except BaseException:
            self._lined.discard(request_id)
            raise

    def held(self) -> int:
        return len(self._held)

    async def in_line(self, conversation_id: str) -> int:
        return int(await self.database.run(lambda c: c.fetchval(IN_LINE, conversation_id)))

    @asynccontextmanager
    async def exclusive(self, key: str) -> AsyncIterator[None]:
        # a transaction's advisory lock, held for the few milliseconds of a request's admission;
        # the block's own database work runs on other connections of the pool
        async with self.database.connection() as conn, conn.transaction():
            await conn.execute(EXCLUSIVE, key)
            yield

    def let_ahead(self, conversation_id: str, request_id: str) -> None:
        # only a turn asking now steps back: a word kept for one not asking (its queue's worker still
        # busy with the turn before) refused its lease when its turn came, as if taken over
        if request_id in self._asking:
            self._stepping_back.add(request_id)
            self._wake(conversation_id)
        elif request_id in self._granted:  # it gives the lease back without running, and keeps its ticket
            self._keeping_place.add(request_id)

    async def leave_line(self, conversation_id: str, request_id: str) -> None:
        self._lined.discard(request_id)
        self._wake(conversation_id)
        try:
            await self.database.run(lambda c: c.execute(LEAVE, request_id, self.daemon_id))
        except KsiError as exc:  # skipped once the request's end is written; removed when the database is back
            log.warning("leave_line_failed", request_id=request_id, error=exc.message)
            self._later(lambda c: c.execute(LEAVE, request_id, self.daemon_id))

    @asynccontextmanager
    async def hold(self, conversation_id: str, request_id: str) -> AsyncIterator[bool]:
        generation = await self._acquire(conversation_id, request_id)
        if generation is None:
            yield False
            return
        self._held[conversation_id] = generation
        self._granted.add(request_id)
        renewing = asyncio.get_running_loop().create_task(self._renew(conversation_id, generation))
        try:
            yield True
        finally:
            await stop_task(renewing)
            if self._held.get(conversation_id) == generation:
                del self._held[conversation_id]
            self._granted.discard(request_id)
            if request_id in self._keeping_place:  # still lined: it asks again after the earlier turn
                self._keeping_place.discard(request_id)
                release, arguments = GIVE_BACK, (conversation_id, generation)
            else:
                self._lined.discard(request_id)
                release, arguments = RELEASE, (conversation_id, request_id, generation, self.daemon_id)
            try:
                await self.database.run(lambda c: c.execute(release, *arguments))
            except KsiError as exc:
                # given back when the database is back (a restart), not only when it expires: the
                # conversation's next turn waits for it
                log.warning("lease_release_failed", conversation_id=conversation_id, error=exc.message)
                self._later(lambda c: c.execute(release, *arguments))
            self._wake(conversation_id)

    async def _acquire(self, conversation_id: str, request_id: str) -> int | None:
        """The generation granted; None when the request left the line meanwhile, or stepped back
        (then it keeps its ticket and asks again later)."""
        self._asking.add(request_id)
        try:
            return await self._ask(conversation_id, request_id)
        finally:
            self._asking.discard(request_id)
            self._stepping_back.discard(request_id)

    async def _ask(self, conversation_id: str, request_id: str) -> int | None:
        while request_id in self._lined and request_id not in self._stepping_back:
            try:
                row = await self.database.run(lambda c: c.fetchrow(
                    ACQUIRE, conversation_id, request_id, self.daemon_id, self.lease))
            except KsiError as exc:
                log.warning("lease_acquire_failed", conversation_id=conversation_id, error=exc.message)
                await asyncio.sleep(RETRY)
                continue
            granted = row["generation"]
            if not row["mine"]:  # taken over while this daemon was silent: the other daemon runs it
                log.warning("turn_taken_over", conversation_id=conversation_id, request_id=request_id)
                self._lined.discard(request_id)
                return None
            if granted is not None:
                if request_id in self._stepping_back:  # an earlier turn goes first: the lease goes back
                    await self.database.run(lambda c: c.execute(GIVE_BACK, conversation_id, granted))
                    return None
                if request_id in self._lined:
                    return int(granted)
                break  # cancelled while the grant was on its way: hand the lease back at once
            self.waits += 1
            ended = self._turn_ended.setdefault(conversation_id, asyncio.Event())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ended.wait(), POLL)
        else:
            return None
        await self.database.run(lambda c: c.execute(RELEASE, conversation_id, request_id, granted, self.daemon_id))
        return None

    def _later(self, work: Callable[[asyncpg.Connection], Awaitable[Any]]) -> None:
        """Try `work` again every `RETRY` seconds, for as long as a lease lasts (it expires by then)."""
        task = asyncio.get_running_loop().create_task(self._until_done(work))
        self._retrying.add(task)
        task.add_done_callback(self._retrying.discard)

    async def _until_done(self, work: Callable[[asyncpg.Connection], Awaitable[Any]]) -> None:
        deadline = time.monotonic() + self.lease
        while time.monotonic() < deadline:
            await asyncio.sleep(RETRY)
            with contextlib.suppress(KsiError):
                await self.database.run(work)
                return

    def _wake(self, conversation_id: str) -> None:
        ended = self._turn_ended.pop(conversation_id, None)
        if ended is not None:
            ended.set()

    async def _renew(self, conversation_id: str, generation: int) -> None:
        while True:
            await asyncio.sleep(self.lease / 3)
            try:
                kept = await self.database.run(lambda c: c.fetchval(RENEW, conversation_id, generation, self.lease))
            except KsiError as exc:
                log.warning("lease_renew_failed", conversation_id=conversation_id, error=exc.message)
                continue
            if kept is None:  # another daemon holds it now: the append will be refused
                log.warning("lease_lost", conversation_id=conversation_id, generation=generation)
                return
