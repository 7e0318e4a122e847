"""Provider-call slots counted over every daemon of one database: the `CallSlots` port.

A scope (a model, or the whole pool) has `limit` numbered places; a call holds one as a row of
`ksi_call_slots` that expires by the database's clock unless renewed (every third of the lease
while the call runs), so a daemon killed mid-call frees its places after one lease. Taking a
place is one statement: the lowest place with no live row, inserted, or taken over from an
expired row; two daemons after the same place find one of them refused, and ask again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import structlog

from ksi_common.errors import KsiError
from ksi_daemon.background import stop_task
from ksi_daemon.storage.postgres.database import Database

log = structlog.get_logger("ksi.storage.postgres")

POLL = 0.05  # seconds between two asks of a call waiting for a place
RETRY = 0.5  # seconds before asking again when the database is away

# $1 scope, $2 limit, $3 this daemon, $4 lease seconds
TAKE = """
INSERT INTO ksi_call_slots AS s (scope, slot, daemon_id, expires_at)
SELECT $1, place, $3, now() + make_interval(secs => $4) FROM generate_series(0, $2 - 1) AS place
WHERE NOT EXISTS (SELECT 1 FROM ksi_call_slots h WHERE h.scope = $1 AND h.slot = place AND h.expires_at >= now())
ORDER BY place LIMIT 1
ON CONFLICT (scope, slot) DO UPDATE SET daemon_id = EXCLUDED.daemon_id, expires_at = EXCLUDED.expires_at
WHERE s.expires_at < now()
RETURNING s.slot
"""

RENEW = "UPDATE ksi_call_slots SET expires_at = now() + make_interval(secs => $4) WHERE scope = $1 AND slot = $2 AND daemon_id = $3"

GIVE_BACK = "DELETE FROM ksi_call_slots WHERE scope = $1 AND slot = $2 AND daemon_id = $3"


class PostgresSlots:
    def __init__(self, database: Database, daemon_id: str, lease: float) -> None:
        self.database = database
        self.daemon_id = daemon_id
        self.lease = lease
        self._freed: dict[str, asyncio.Event] = {}  # scope -> set when a call of this daemon gives one back
        self.waits = 0  # asks that found every place taken

    @asynccontextmanager
    async def hold(self, scope: str, limit: int) -> AsyncIterator[None]:
        slot = await self._take(scope, limit)
        renewing = asyncio.get_running_loop().create_task(self._renew(scope, slot))
        try:
            yield
        finally:
            await stop_task(renewing)
            try:
                await self.database.run(lambda c: c.execute(GIVE_BACK, scope, slot, self.daemon_id))
            except KsiError as exc:  # it expires by itself
                log.warning("slot_release_failed", scope=scope, error=exc.message)
            freed = self._freed.pop(scope, None)
            if freed is not None:
                freed.set()

    async def _take(self, scope: str, limit: int) -> int:
        while True:
            try:
                slot = await self.database.run(lambda c: c.fetchval(TAKE, scope, limit, self.daemon_id, self.lease))
            except KsiError as exc:
                log.warning("slot_take_failed", scope=scope, error=exc.message)
                await asyncio.sleep(RETRY)
                continue
            if slot is not None:
                return int(slot)
            self.waits += 1
            freed = self._freed.setdefault(scope, asyncio.Event())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(freed.wait(), POLL)

    async def _renew(self, scope: str, slot: int) -> None:
        while True:
            await asyncio.sleep(self.lease / 3)
            try:
                await self.database.run(lambda c: c.execute(RENEW, scope, slot, self.daemon_id, self.lease))
            except KsiError as exc:
                log.warning("slot_renew_failed", scope=scope, error=exc.message)
