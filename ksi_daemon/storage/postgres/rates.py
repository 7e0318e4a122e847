"""Each model's calls and tokens of the last minute, over every daemon of one database: the
`CallRates` port. A call is counted (a row of `ksi_call_rates`) only when the minute has room for
it, checked and counted in one transaction under a transaction-level advisory lock on the model
(held for those two statements only), so two daemons never both take the last place. Times are
the database's. Rows older than the minute are swept by the same transaction."""

from __future__ import annotations

import asyncpg

from ksi_daemon.storage.ports import RateDecision
from ksi_daemon.storage.postgres.database import Database

WINDOW = "60 seconds"

SWEEP_AND_COUNT = f"""
WITH swept AS (DELETE FROM ksi_call_rates WHERE model = $1 AND at <= now() - interval '{WINDOW}')
SELECT count(*) AS calls, coalesce(sum(tokens), 0) AS tokens,
       coalesce(extract(epoch FROM min(at) + interval '{WINDOW}' - now()), 0)::float8 AS wait
FROM ksi_call_rates WHERE model = $1 AND at > now() - interval '{WINDOW}'
"""


class PostgresRates:
    def __init__(self, database: Database) -> None:
        self.database = database

    async def admit(self, model: str, per_minute: int | None, tokens_per_minute: int | None,
                    tokens: int) -> RateDecision:
        async def work(conn: asyncpg.Connection) -> RateDecision:
            async with conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock(hashtext('ksi-rate:' || $1))", model)
                row = await conn.fetchrow(SWEEP_AND_COUNT, model)
                calls, used = int(row["calls"]), int(row["tokens"])
                if (per_minute is not None and calls >= per_minute) or (
                        tokens_per_minute is not None and calls and used + tokens > tokens_per_minute):
                    return RateDecision(None, round(max(0.0, float(row["wait"])), 3))
                grant = await conn.fetchval(
                    "INSERT INTO ksi_call_rates (model, tokens) VALUES ($1, $2) RETURNING grant_id", model, tokens)
                return RateDecision(int(grant))

        return await self.database.run(work, retry=False)

    async def settle(self, model: str, grant: int, tokens: int) -> None:
        await self.database.run(lambda c: c.execute(
            "UPDATE ksi_call_rates SET tokens = $2 WHERE grant_id = $1", grant, tokens))
