"""The connection pool, and the one place where database failures become KSI errors.

A lost or refused connection is `storage_unavailable` (the daemon keeps serving what needs no
database and recovers when it returns); any other database failure is `storage_error`. URLs in
messages always have their password masked.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import asyncpg
import structlog

from ksi_common.dburl import mask_url, mask_urls_in
from ksi_common.errors import ErrorCode, KsiError
from ksi_common.postgres_reader import init_connection
from ksi_daemon.storage.postgres.migrate import MigrationReport, migrate

log = structlog.get_logger("ksi.storage.postgres")

T = TypeVar("T")

CONNECT_TIMEOUT = 10.0
POOL_SIZE = 10

# failures of the connection rather than of the statement: the server is away, restarting or full
_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    asyncio.TimeoutError,
    asyncpg.PostgresConnectionError,  # class 08
    asyncpg.exceptions.OperatorInterventionError,  # class 57: admin shutdown, cannot connect now
    asyncpg.exceptions.TooManyConnectionsError,
    asyncpg.exceptions.InsufficientResourcesError,
    asyncpg.InterfaceError,  # the connection or pool is closed
    asyncpg.exceptions.InternalClientError,
)


class StorageUnavailable(KsiError):
    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(ErrorCode.STORAGE_UNAVAILABLE, message, **details)


def is_connection_error(exc: BaseException) -> bool:
    return isinstance(exc, _CONNECTION_ERRORS)


def as_ksi_error(exc: BaseException) -> KsiError:
    """A database failure as the error a client sees (no URL password, no SQL text)."""
    if isinstance(exc, KsiError):
        return exc
    reason = mask_urls_in(f"{type(exc).__name__}: {exc}")[:300]
    if is_connection_error(exc):
        return StorageUnavailable("the database is unavailable; try again when it is back", reason=reason)
    if isinstance(exc, asyncpg.exceptions.DiskFullError):
        return KsiError(ErrorCode.STORAGE_ERROR, "the database is out of disk space", reason=reason)
    return KsiError(ErrorCode.STORAGE_ERROR, "the database refused an operation", reason=reason)


async def _nothing_to_reset(_conn: asyncpg.Connection) -> None:
    """Connections go back to the pool as they are: this code leaves no session state behind
    (transactions are closed by their blocks, and asyncpg rolls back any still open itself),
    so the default reset query, a round trip on every release, buys nothing."""


class Database:
    """A pool on one database URL; `open()` connects and migrates, `close()` lets go."""

    def __init__(self, url: str, pool_size: int = POOL_SIZE, connect_timeout: float = CONNECT_TIMEOUT) -> None:
        self.url = url
        self.shown_url = mask_url(url)
        self.pool_size = pool_size
        self.connect_timeout = connect_timeout
        self._pool: asyncpg.Pool | None = None
        self.migration: MigrationReport | None = None
        self.calls = 0  # units of work run (each a pool checkout and at least one round trip)

    async def open(self) -> MigrationReport:
        """Connect and bring the schema up to date; raises StorageUnavailable or SchemaTooNew."""
        try:
            pool = await asyncpg.create_pool(
                self.url, min_size=1, max_size=self.pool_size, timeout=self.connect_timeout,
                init=init_connection, reset=_nothing_to_reset, command_timeout=60,
            )
        except Exception as exc:
            raise StorageUnavailable(
                f"cannot connect to the database at {self.shown_url}: {mask_urls_in(str(exc)) or type(exc).__name__}",
                url=self.shown_url,
            ) from None
        try:
            async with pool.acquire() as conn:
                self.migration = await migrate(conn)
        except BaseException:
            await pool.close()
            raise
        self._pool = pool
        log.info("database_opened", url=self.shown_url, schema_version=self.migration.after,
                 migrated=self.migration.applied)
        return self.migration

    async def close(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            try:
                await asyncio.wait_for(pool.close(), 5.0)
            except Exception:  # a pool whose server went away: let its connections go by force
                pool.terminate()

    @property
    def pool(self) -> asyncpg.Pool:
        if self._pool is None:
            raise StorageUnavailable("the database is not open")
        return self._pool

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[asyncpg.Connection]:
        """A pooled connection; database failures inside come out as KsiError."""
        try:
            async with self.pool.acquire() as conn:
                yield conn
        except KsiError:
            raise
        except (asyncpg.PostgresError, *_CONNECTION_ERRORS) as exc:
            raise as_ksi_error(exc) from exc

    async def run(self, work: Callable[[asyncpg.Connection], Awaitable[T]], retry: bool = True) -> T:
        """`work` on a pooled connection. With `retry`, a connection found dead (the server
        restarted since it was opened) is replaced once: only for work that is safe to repeat."""
        self.calls += 1
        attempts = 2 if retry else 1
        for attempt in range(attempts):
            try:
                async with self.pool.acquire() as conn:
                    return await work(conn)
            except KsiError:
                raise
            except (asyncpg.PostgresError, *_CONNECTION_ERRORS) as exc:
                if attempt + 1 < attempts and is_connection_error(exc):
                    # one session found dead: the server most likely restarted, and the pool's other
                    # idle sessions died with it; the retry must not be handed the next dead one
                    await self.pool.expire_connections()
                    continue
                raise as_ksi_error(exc) from exc
        raise AssertionError("unreachable")
