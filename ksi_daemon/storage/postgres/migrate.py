"""Bringing a database to the schema this code needs: versioned, idempotent, one daemon at a time.

Every migration runs in its own transaction (PostgreSQL's DDL is transactional), together with
the row that records it in `ksi_schema`: one interrupted half-way leaves no trace and is simply run
again. A session advisory lock makes daemons that start together take turns; the second finds the
work done. A database already at a newer version than this code knows is refused, never touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import asyncpg
import structlog

from ksi_common.errors import ErrorCode, KsiError
from ksi_daemon.storage.postgres.schema import MIGRATIONS, Migration

log = structlog.get_logger("ksi.storage.postgres")

# pg_advisory_lock takes a bigint: a fixed key of our own (the bytes of "ksi-schm")
LOCK_KEY = int.from_bytes(b"ksi-schm", "big") & 0x7FFF_FFFF_FFFF_FFFF
LOCK_WAIT = "60s"  # another daemon migrating for longer than this is stuck, not slow


class SchemaTooNew(KsiError):
    def __init__(self, found: int, known: int) -> None:
        super().__init__(
            ErrorCode.STORAGE_ERROR,
            f"the database schema is at version {found}, newer than this KSI knows ({known}); "
            "upgrade KSI instead of running an older one against it",
            schema_version=found, supported_version=known,
        )


@dataclass(frozen=True, slots=True)
class MigrationReport:
    before: int
    after: int

    @property
    def applied(self) -> int:
        return self.after - self.before


CREATE_VERSIONS = """
CREATE TABLE IF NOT EXISTS ksi_schema (
    version integer PRIMARY KEY,
    description text NOT NULL,
    applied timestamptz NOT NULL DEFAULT now()
)
"""


async def schema_version(conn: asyncpg.Connection) -> int:
    """The version a database is at (0: never migrated)."""
    exists = await conn.fetchval("SELECT to_regclass('ksi_schema') IS NOT NULL")
    if not exists:
        return 0
    return int(await conn.fetchval("SELECT coalesce(max(version), 0) FROM ksi_schema"))


async def migrate(conn: asyncpg.Connection, migrations: Sequence[Migration] = MIGRATIONS) -> MigrationReport:
    """Apply every migration newer than the database's version, in order; raises SchemaTooNew."""
    known = migrations[-1].version
    await conn.execute(f"SET lock_timeout = '{LOCK_WAIT}'")
    try:
        await conn.execute("SELECT pg_advisory_lock($1)", LOCK_KEY)
    except asyncpg.LockNotAvailableError:
        raise KsiError(ErrorCode.STORAGE_UNAVAILABLE,
                       f"another daemon has been migrating the database schema for over {LOCK_WAIT}") from None
    try:
        await conn.execute(CREATE_VERSIONS)
        before = await schema_version(conn)
        if before > known:
            raise SchemaTooNew(before, known)
        current = before
        for migration in migrations:
            if migration.version <= current:
                continue
            async with conn.transaction():
                for statement in migration.statements:
                    await conn.execute(statement)
                await conn.execute("INSERT INTO ksi_schema (version, description) VALUES ($1, $2)",
                                   migration.version, migration.description)
            current = migration.version
            log.info("schema_migrated", version=current, description=migration.description)
        return MigrationReport(before, current)
    finally:
        if not conn.is_closed():  # a closed connection took its session lock with it
            try:
                await conn.execute("SELECT pg_advisory_unlock($1)", LOCK_KEY)
                await conn.execute("RESET lock_timeout")
            except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError):
                log.warning("schema_unlock_failed")
