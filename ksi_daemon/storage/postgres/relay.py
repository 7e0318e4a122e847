"""Events of one daemon reaching the subscribers of the others, over LISTEN/NOTIFY.

Each daemon publishes its completion outcomes on one channel and listens on it with a dedicated
connection, ignoring its own. A payload too large for a notification (8000 bytes) is stored in a
table and the notification carries its id. The listening connection is re-opened whenever it is
lost (the database restarted); events published while it was away are not replayed: this is a
live feed, the conversations themselves are in the database.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import asyncpg
import orjson
import structlog

from ksi_common.errors import KsiError
from ksi_common.postgres_reader import init_connection
from ksi_daemon.storage.postgres.database import Database

log = structlog.get_logger("ksi.storage.postgres")

CHANNEL = "ksi_events"
INLINE_LIMIT = 7000  # bytes of a notification payload; the server's limit is 8000
RECONNECT_DELAY = 0.5
KEEP_STORED = "5 minutes"  # large payloads are read within milliseconds; older ones are swept

Deliver = Callable[[str, dict[str, Any], dict[str, Any]], None]
Listener = Callable[[Any, int, str, str], None]  # (connection, server pid, channel, payload)


class PostgresRelay:
    def __init__(self, database: Database, daemon_id: str) -> None:
        self.database = database
        self.daemon_id = daemon_id
        self._deliver: Deliver | None = None
        self._also: list[tuple[str, Listener]] = []  # other channels heard on the same connection
        self._outbox: asyncio.Queue[bytes] = asyncio.Queue(maxsize=10_000)
        self._tasks: list[asyncio.Task[None]] = []
        self._listening = asyncio.Event()
        self._lost = asyncio.Event()
        self.published = 0
        self.received = 0
        self._prefix = daemon_id.encode() + b"\n"

    async def start(self, deliver: Deliver) -> None:
        """Deliver other daemons' events to `deliver(event, data, context)` from now on."""
        self._deliver = deliver
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._listen()), loop.create_task(self._send())]
        with contextlib.suppress(TimeoutError):  # a database that went away again: serve anyway
            await asyncio.wait_for(self._listening.wait(), 10)

    def listen_also(self, channel: str, listener: Listener) -> None:
        """Hear `channel` too (before `start`); notifications sent while the connection was lost
        are not heard."""
        self._also.append((channel, listener))

    def publish(self, event: str, data: dict[str, Any], context: dict[str, Any]) -> None:
        """Queue an event for the other daemons; never waits (dropped with a warning when full)."""
        # the sender's id first, before the JSON: a daemon skips its own events without parsing them
        payload = self._prefix + orjson.dumps({"event": event, "data": data, "context": context}, default=str)
        try:
            self._outbox.put_nowait(payload)
        except asyncio.QueueFull:
            log.warning("relay_outbox_full", event=event)

    async def _send(self) -> None:
        while True:
            payload = await self._outbox.get()
            try:
                await self.database.run(lambda c: self._notify(c, payload), retry=False)
                self.published += 1
            except KsiError as exc:
                log.warning("relay_publish_failed", error=exc.message)

    async def _notify(self, conn: asyncpg.Connection, payload: bytes) -> None:
        if len(payload) > INLINE_LIMIT:
            stored = await conn.fetchval(
                "INSERT INTO ksi_relayed_events (payload) VALUES ($1::json) RETURNING id",
                orjson.loads(payload[len(self._prefix):]))
            payload = self._prefix + orjson.dumps({"ref": stored})
            await conn.execute(f"DELETE FROM ksi_relayed_events WHERE sent < now() - interval '{KEEP_STORED}'")
        await conn.execute("SELECT pg_notify($1, $2)", CHANNEL, payload.decode())

    async def _listen(self) -> None:
        while True:
            conn: asyncpg.Connection | None = None
            try:
                conn = await asyncpg.connect(self.database.url, timeout=self.database.connect_timeout)
                await init_connection(conn)
                self._lost.clear()
                conn.add_termination_listener(lambda _c: self._lost.set())
                await conn.add_listener(CHANNEL, self._on_notification)
                for channel, listener in self._also:
                    await conn.add_listener(channel, listener)
                self._listening.set()
                await self._lost.wait()
                log.warning("relay_connection_lost")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("relay_connect_failed", error=type(exc).__name__)
            finally:
                self._listening.clear()
                if conn is not None and not conn.is_closed():
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(conn.close(), 2)
            await asyncio.sleep(RECONNECT_DELAY)

    def _on_notification(self, _conn: Any, _pid: int, _channel: str, payload: str) -> None:
        origin, _newline, body = payload.partition("\n")
        if origin == self.daemon_id or self._deliver is None:
            return  # our own event, already delivered here
        try:
            message = orjson.loads(body)
        except orjson.JSONDecodeError:
            return
        if "ref" in message:
            asyncio.get_running_loop().create_task(self._fetch_stored(int(message["ref"])))
            return
        self._hand_over(message)

    async def _fetch_stored(self, stored: int) -> None:
        try:
            message = await self.database.run(lambda c: c.fetchval(
                "SELECT payload FROM ksi_relayed_events WHERE id = $1", stored))
        except KsiError as exc:
            log.warning("relay_fetch_failed", error=exc.message)
            return
        if isinstance(message, dict):
            self._hand_over(message)

    def _hand_over(self, message: dict[str, Any]) -> None:
        if self._deliver is None:
            return
        self.received += 1
        self._deliver(str(message.get("event")), message.get("data") or {}, message.get("context") or {})

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
