"""The PostgreSQL schema: created and migrated on open, idempotent, safe when two daemons start at
once, a newer schema refused, a migration interrupted half-way run again, an unreachable server
reported clearly with the URL's password masked."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from ksi_common.dburl import mask_url, mask_urls_in, url_password
from ksi_common.errors import KsiError
from ksi_daemon.storage.postgres.database import Database
from ksi_daemon.storage.postgres.migrate import SchemaTooNew, migrate, schema_version
from ksi_daemon.storage.postgres.schema import MIGRATIONS, SCHEMA_VERSION, Migration
from tests.pg_cluster import PASSWORD, ThrowawayCluster


async def tables(url: str) -> set[str]:
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        return {r["tablename"] for r in rows}
    finally:
        await conn.close()


async def test_open_creates_the_schema_once_and_again_is_a_no_op(pg_url: str) -> None:
    first = Database(pg_url)
    report = await first.open()
    await first.close()
    assert (report.before, report.after) == (0, SCHEMA_VERSION)
    assert {"ksi_schema", "ksi_conversations", "ksi_exchanges", "ksi_responses", "ksi_agents",
            "ksi_consortia", "ksi_consortium_traces", "ksi_relayed_events", "ksi_summaries", "ksi_calibration"} <= await tables(pg_url)
    again = Database(pg_url)
    report = await again.open()
    await again.close()
    assert (report.before, report.after, report.applied) == (SCHEMA_VERSION, SCHEMA_VERSION, 0)


async def test_two_daemons_opening_at_once_migrate_once(pg_url: str) -> None:
    databases = [Database(pg_url) for _ in range(4)]
    reports = await asyncio.gather(*(d.open() for d in databases))
    await asyncio.gather(*(d.close() for d in databases))
    assert sorted(r.applied for r in reports) == [0, 0, 0, SCHEMA_VERSION]
    conn = await asyncpg.connect(pg_url)
    try:
        versions = [r["version"] for r in await conn.fetch("SELECT version FROM ksi_schema ORDER BY version")]
    finally:
        await conn.close()
    assert versions == [m.version for m in MIGRATIONS]


async def test_a_newer_schema_is_refused_and_left_untouched(pg_url: str) -> None:
    database = Database(pg_url)
    await database.open()
    await database.close()
    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute("INSERT INTO ksi_schema (version, description) VALUES ($1, 'from the future')",
                           SCHEMA_VERSION + 1)
        before = await tables(pg_url)
        with pytest.raises(SchemaTooNew) as refused:
            await Database(pg_url).open()
        assert refused.value.code == "storage_error"
        assert f"version {SCHEMA_VERSION + 1}" in refused.value.message and "upgrade KSI" in refused.value.message
        assert await tables(pg_url) == before
        assert await schema_version(conn) == SCHEMA_VERSION + 1
    finally:
        await conn.close()


async def test_a_migration_that_fails_half_way_leaves_nothing_and_runs_again(pg_url: str) -> None:
    broken = (*MIGRATIONS, Migration(SCHEMA_VERSION + 1, "half done", (
        "CREATE TABLE ksi_half_done (x int)",
        "SELECT no_such_function()",
    )))
    conn = await asyncpg.connect(pg_url)
    try:
        with pytest.raises(asyncpg.UndefinedFunctionError):
            await migrate(conn, broken)
        assert await schema_version(conn) == SCHEMA_VERSION  # the good ones stay applied
        assert "ksi_half_done" not in await tables(pg_url)  # the broken one left nothing
        assert await conn.fetchval("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'") == 0
        fixed = (*MIGRATIONS, Migration(SCHEMA_VERSION + 1, "half done", ("CREATE TABLE ksi_half_done (x int)",)))
        report = await migrate(conn, fixed)
        assert (report.before, report.after) == (SCHEMA_VERSION, SCHEMA_VERSION + 1)
        assert "ksi_half_done" in await tables(pg_url)
    finally:
        await conn.close()


async def test_a_migration_killed_mid_statement_is_run_again_to_the_end(pg_url: str) -> None:
    """The server ends the migrating connection (as when a daemon dies) in the middle of a step."""
    slow = (*MIGRATIONS, Migration(SCHEMA_VERSION + 1, "slow", (
        "CREATE TABLE ksi_slow (x int)",
        "SELECT pg_sleep(30)",
    )))
    migrating = await asyncpg.connect(pg_url)
    pid = migrating.get_server_pid()
    task = asyncio.ensure_future(migrate(migrating, slow))
    admin = await asyncpg.connect(pg_url)
    try:
        while not await admin.fetchval("SELECT wait_event = 'PgSleep' FROM pg_stat_activity WHERE pid = $1", pid):
            await asyncio.sleep(0.02)
        await admin.execute("SELECT pg_terminate_backend($1)", pid)
        with pytest.raises((asyncpg.PostgresError, asyncpg.InterfaceError, ConnectionError)):
            await task
        assert await schema_version(admin) == SCHEMA_VERSION
        assert "ksi_slow" not in await tables(pg_url)
        # the lock died with the connection: a new daemon gets it at once and finishes the job
        fast = (*MIGRATIONS, Migration(SCHEMA_VERSION + 1, "slow", ("CREATE TABLE ksi_slow (x int)",)))
        report = await migrate(admin, fast)
        assert report.after == SCHEMA_VERSION + 1 and "ksi_slow" in await tables(pg_url)
    finally:
        await admin.close()
        await migrating.close()


async def test_an_unreachable_database_is_a_clear_error_without_the_password(pg_cluster: ThrowawayCluster) -> None:
    with pytest.raises(KsiError) as refused:
        await Database(f"postgresql://ksi:{PASSWORD}@127.0.0.1:1/nowhere", connect_timeout=3).open()
    assert refused.value.code == "storage_unavailable"
    assert "127.0.0.1:1/nowhere" in refused.value.message
    assert PASSWORD not in refused.value.message and PASSWORD not in str(refused.value.details)
    with pytest.raises(KsiError) as denied:
        await Database(pg_cluster.url("postgres", password="wrong-password-123")).open()
    assert denied.value.code == "storage_unavailable"
    assert "wrong-password-123" not in denied.value.message


def test_urls_are_masked_wherever_they_are_shown() -> None:
    assert mask_url("postgresql://ksi:s3cret@db:5432/ksi") == "postgresql://ksi:***@db:5432/ksi"
    assert mask_url("postgresql://ksi@db/ksi") == "postgresql://ksi@db/ksi"
    assert mask_url("postgresql://db/ksi?user=k&password=s3cret") == "postgresql://db/ksi?user=k&password=***"
    assert mask_url("postgres://u:p%40ss@h1:5432,h2:5433/d") == "postgres://u:***@h1:5432,h2:5433/d"
    text = "failed: postgresql://ksi:s3cret@db/ksi and postgres://a:b@c/d"
    assert mask_urls_in(text) == "failed: postgresql://ksi:***@db/ksi and postgres://a:***@c/d"
    assert url_password("postgresql://ksi:s3cret@db/ksi") == "s3cret"
    assert url_password("postgresql://u:p%40ss@h/d") == "p@ss"
    assert url_password("postgresql://ksi@db/ksi") is None
