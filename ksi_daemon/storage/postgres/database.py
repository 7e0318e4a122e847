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


class Database:
    """Connections to one database URL; `open()` connects and migrates, `close()` lets go.

    Its own small pool: up to `pool_size` connections, each taken for one unit of work and put back
    as it is. asyncpg's pool costs about as much CPU as the statement it serves (a holder, a proxy,
    an inactivity timer, a reset under a timeout, and a task to shield each release: 38 us against
    35 us for a one-row SELECT, measured apart), and a turn on the pool runs eight units of work.
    A connection whose work failed other than by a statement's error, or left a transaction open,
    is closed rather than put back: its state is not known (a cancelled query may still be running).
    """

    def __init__(self, url: str, pool_size: int = POOL_SIZE, connect_timeout: float = CONNECT_TIMEOUT) -> None:
        self.url = url
        self.shown_url = mask_url(url)
        self.pool_size = pool_size
        self.connect_timeout = connect_timeout
        self._idle: list[asyncpg.Connection] = []
        self._slots = asyncio.Semaphore(pool_size)  # connections out at once
        self._open = False
        self.migration: MigrationReport | None = None
        self.calls = 0  # units of work run (each a checkout and at least one round trip)

    async def open(self) -> MigrationReport:
        """Connect and bring the schema up to date; raises StorageUnavailable or SchemaTooNew."""
        try:
            conn = await self._connect()
        except Exception as exc:
            raise StorageUnavailable(
                f"cannot connect to the database at {self.shown_url}: {mask_urls_in(str(exc)) or type(exc).__name__}",
                url=self.shown_url,
            ) from None
        try:
            self.migration = await migrate(conn)
        except BaseException:
            conn.terminate()
            raise
        self._idle.append(conn)
        self._open = True
        log.info("database_opened", url=self.shown_url, schema_version=self.migration.after,
                 migrated=self.migration.applied)
        return self.migration

    async def _connect(self) -> asyncpg.Connection:
        conn = await asyncpg.connect(self.url, timeout=self.connect_timeout, command_timeout=60)
        try:
            await init_connection(conn)
        except BaseException:
            conn.terminate()
            raise
        return conn

    async def close(self) -> None:
        """Close the idle connections; one still in use is closed when its work ends."""
        self._open = False
        idle, self._idle = self._idle, []
        for conn in idle:
            try:
                await asyncio.wait_for(conn.close(), 5.0)
            except Exception:  # a server that went away: let the connection go by force
                conn.terminate()

    @asynccontextmanager
    async def _checkout(self) -> AsyncIterator[asyncpg.Connection]:
        if not self._open:
            raise StorageUnavailable("the database is not open")
        async with self._slots:
            conn = None
            while self._idle and conn is None:
                conn = self._idle.pop()
                if conn.is_closed():  # lost while idle (the server restarted): connect anew
                    conn = None
            if conn is None:
                conn = await self._connect()
            reusable = False
            try:
                yield conn
                reusable = True
            except (KsiError, asyncpg.PostgresError) as exc:
                # the statement's own failure (or the work's): the connection is as good as before
                reusable = not is_connection_error(exc)
                raise
            finally:
                if reusable and self._open and not conn.is_closed() and not conn.is_in_transaction():
                    self._idle.append(conn)
                else:
                    conn.terminate()

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[asyncpg.Connection]:
        """A pooled connection; database failures inside come out as KsiError."""
        try:
            async with self._checkout() as conn:
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
                async with self._checkout() as conn:
                    return await work(conn)
            except KsiError:
                raise
            except (asyncpg.PostgresError, *_CONNECTION_ERRORS) as exc:
                if attempt + 1 < attempts and is_connection_error(exc):
                    continue
                raise as_ksi_error(exc) from exc
        raise AssertionError("unreachable")
