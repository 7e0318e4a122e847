"""The daemons serving one database, in `ksi_daemons`: one row each, kept fresh by its heartbeat.

Every time here is the database's (`now()`), and ages are computed by it: the daemons may run on
hosts whose clocks disagree, and a row written by one is judged by another. A daemon's start is
stored as the database's now minus the daemon's own uptime (a duration, which one host measures
well), so a daemon registering again after its row was pruned keeps its start.
"""

from __future__ import annotations

from datetime import UTC

import asyncpg

from ksi_common.timefmt import format_ts
from ksi_daemon.storage.ports import DaemonInfo, PoolMember
from ksi_daemon.storage.postgres.database import Database

BEAT = """
INSERT INTO ksi_daemons (daemon_id, host, pid, version, started, heartbeat, in_flight, queued, leases)
VALUES ($1, $2, $3, $4, now() - make_interval(secs => $5), now(), $6, $7, $8)
ON CONFLICT (daemon_id) DO UPDATE SET heartbeat = now(), in_flight = EXCLUDED.in_flight, queued = EXCLUDED.queued,
    leases = EXCLUDED.leases
RETURNING xmax = 0
"""  # xmax is 0 on a row this statement inserted, not on one it updated

PRUNE = "DELETE FROM ksi_daemons WHERE heartbeat < now() - make_interval(secs => $1)"

MEMBERS = """
SELECT daemon_id, host, pid, version, started, extract(epoch FROM now() - heartbeat)::float8 AS age,
       in_flight, queued, leases, heartbeat < now() - make_interval(secs => $1) AS stale
FROM ksi_daemons ORDER BY started, daemon_id
"""


class PostgresDaemons:
    def __init__(self, database: Database) -> None:
        self.database = database

    @property
    def shared(self) -> bool:
        return True

    async def beat(self, me: DaemonInfo, uptime: float, in_flight: int, queued: int, leases: int) -> bool:
        inserted = await self.database.run(lambda c: c.fetchval(
            BEAT, me.daemon_id, me.host, me.pid, me.version, float(uptime), in_flight, queued, leases))
        return bool(inserted)

    async def members(self, stale_after: float, prune_after: float) -> list[PoolMember]:
        async def read(conn: asyncpg.Connection) -> list[asyncpg.Record]:
            await conn.execute(PRUNE, float(prune_after))
            return list(await conn.fetch(MEMBERS, float(stale_after)))

        rows = await self.database.run(read)
        return [PoolMember(
            daemon_id=row["daemon_id"], host=row["host"], pid=row["pid"], version=row["version"],
            started=format_ts(row["started"].astimezone(UTC).timestamp()),
            heartbeat_age=max(0.0, float(row["age"])), in_flight=row["in_flight"], queued=row["queued"],
            stale=bool(row["stale"]), leases=row["leases"],
        ) for row in rows]

    async def leave(self, daemon_id: str) -> None:
        await self.database.run(lambda c: c.execute("DELETE FROM ksi_daemons WHERE daemon_id = $1", daemon_id))
