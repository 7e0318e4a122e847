"""The PostgreSQL backend's connections (storage/postgres/database.py): never more than the pool's
size at once, a session kept after a statement's error, the next work after one cancelled
mid-statement served at once on a clean session, none left open after close."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from ksi_common.errors import ErrorCode, KsiError
from ksi_daemon.storage.postgres.database import Database
from tests.pg_cluster import ThrowawayCluster


async def backend_pid(conn: asyncpg.Connection) -> int:
    return int(await conn.fetchval("SELECT pg_backend_pid()"))


def database_name(url: str) -> str:
    return url.rsplit("/", 1)[1]


def sessions(cluster: ThrowawayCluster, database: str) -> int:
    """Client sessions on `database` now (the administrator's own psql is on another database)."""
    return int(cluster.psql(f"SELECT count(*) FROM pg_stat_activity WHERE datname = '{database}'"))


async def test_never_more_connections_at_once_than_the_pool_size(pg_url: str) -> None:
    database = Database(pg_url, pool_size=2)
    await database.open()
    try:
        async def slow(conn: asyncpg.Connection) -> int:
            await conn.execute("SELECT pg_sleep(0.05)")
            return await backend_pid(conn)

        pids = await asyncio.gather(*(database.run(slow) for _ in range(8)))
    finally:
        await database.close()
    assert len(pids) == 8
    assert len(set(pids)) <= 2


async def test_a_statement_error_keeps_its_connection_and_is_storage_error(pg_url: str) -> None:
    database = Database(pg_url, pool_size=1)
    await database.open()
    try:
        first = await database.run(backend_pid)
        with pytest.raises(KsiError) as caught:
            await database.run(lambda c: c.fetchval("SELECT 1 / 0"))
        again = await database.run(backend_pid)
    finally:
        await database.close()
    assert caught.value.code == ErrorCode.STORAGE_ERROR
    assert again == first  # the same session: nothing was reconnected


async def test_work_cancelled_mid_statement_leaves_the_next_work_a_clean_connection(pg_url: str) -> None:
    database = Database(pg_url, pool_size=1)
    await database.open()
    try:
        first = await database.run(backend_pid)
        sleeping = asyncio.ensure_future(database.run(lambda c: c.execute("SELECT pg_sleep(30)")))
        await asyncio.sleep(0.3)
        sleeping.cancel()
        with pytest.raises(asyncio.CancelledError):
            await sleeping
        # handed a session whose statement still runs, this would fail (another operation in
        # progress) or wait the 30 s out
        after = await asyncio.wait_for(database.run(backend_pid), 10)
        assert await database.run(lambda c: c.fetchval("SELECT 41 + 1")) == 42
        running = await database.run(lambda c: c.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'SELECT pg_sleep(30)%' AND state = 'active'"))
    finally:
        await database.close()
    assert first > 0 and after > 0
    assert running == 0  # the cancelled statement was cancelled on the server too


async def test_close_leaves_no_session_open_and_refuses_work(pg_cluster: ThrowawayCluster, pg_url: str) -> None:
    database = Database(pg_url, pool_size=4)
    await database.open()

    async def slow(conn: asyncpg.Connection) -> None:
        await conn.execute("SELECT pg_sleep(0.05)")

    await asyncio.gather(*(database.run(slow) for _ in range(4)))
    assert sessions(pg_cluster, database_name(pg_url)) == 4
    await database.close()
    for _ in range(50):  # the server notices a closed session a moment later
        if sessions(pg_cluster, database_name(pg_url)) == 0:
            break
        await asyncio.sleep(0.1)
    assert sessions(pg_cluster, database_name(pg_url)) == 0
    with pytest.raises(KsiError) as caught:
        await database.run(backend_pid)
    assert caught.value.code == ErrorCode.STORAGE_UNAVAILABLE


async def test_work_after_the_server_dropped_every_session_runs_on_a_new_one(
        pg_cluster: ThrowawayCluster, pg_url: str) -> None:
    """As after a restart of the server: every pooled session is dead, and the first work that meets
    one is retried on a new one, not on the next dead one (which failed it with storage_unavailable,
    about one run in ten on a loaded machine, when this loop had not yet read that they ended)."""
    database = Database(pg_url, pool_size=3)
    await database.open()
    try:
        async def slow(conn: asyncpg.Connection) -> int:
            await conn.execute("SELECT pg_sleep(0.05)")
            return await backend_pid(conn)

        before = set(await asyncio.gather(*(database.run(slow) for _ in range(3))))
        assert len(before) == 3
        cluster_pids = ", ".join(str(pid) for pid in before)
        pg_cluster.psql(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid IN ({cluster_pids})")
        after = [await database.run(backend_pid) for _ in range(3)]
    finally:
        await database.close()
    assert not set(after) & before
