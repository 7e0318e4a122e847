"""The `Caller` of `ksi mcp`: one pipelined connection to the daemon's socket, opened on first
use, reopened after the daemon went away, and starting the daemon when none answers.

Every call in flight shares the connection, so a request the daemon would refuse for its size
(and answer by closing the connection) is refused here before it is sent: the daemon's frame
limit is asked for when the connection opens."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ksi_common.client import KsiClient
from ksi_common.errors import ErrorCode, KsiError
from ksi_common.events import MONITOR_SUBSCRIBE, MONITOR_UNSUBSCRIBE, SYSTEM_CONFIG
from ksi_mcp.caller import EventListener, StopWatching

# Starts a daemon (blocking; run in a thread) and returns what to tell the user; raises on failure.
StartDaemon = Callable[[], str]


class SocketCaller:
    def __init__(self, socket_path: str | Path, start_daemon: StartDaemon | None = None,
                 say: Callable[[str], None] = lambda _text: None) -> None:
        self.socket_path = str(socket_path)
        self.start_daemon = start_daemon
        self.say = say  # `ksi mcp` writes these to stderr: stdout carries the protocol
        self._client: KsiClient | None = None
        self._subscriptions: dict[str, str] = {}  # event -> monitor subscription id on the open connection
        self._pump: asyncio.Task[None] | None = None
        self._opening = asyncio.Lock()
        self._subscribing = asyncio.Lock()  # calls watching at once must not subscribe an event twice
        self._watchers: dict[int, tuple[tuple[str, ...], EventListener]] = {}
        self._next_watcher = 0

    async def request(self, event: str, data: dict[str, Any]) -> dict[str, Any]:
        client = await self._connection()
        return await client.request(event, data)

    async def watch(self, events: tuple[str, ...], listener: EventListener) -> StopWatching:
        key = self._next_watcher
        self._next_watcher += 1
        self._watchers[key] = (events, listener)
        # A daemon that is down now gets the subscription when a later call reconnects.
        with contextlib.suppress(KsiError):
            await self._subscribe(await self._connection())

        async def stop() -> None:
            self._watchers.pop(key, None)
            with contextlib.suppress(KsiError):  # a connection gone took its subscriptions along
                await self._unsubscribe_unwatched()

        return stop

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.close()
        if self._pump is not None:
            await asyncio.gather(self._pump, return_exceptions=True)

    # -- the connection ---------------------------------------------------------
    async def _connection(self) -> KsiClient:
        async with self._opening:
            if self._client is not None:
                return self._client
            client = await self._connect_or_start()
            self._client, self._subscriptions = client, {}
            self._pump = asyncio.create_task(self._dispatch(client))
            try:
                client.frame_limit = (await client.request(SYSTEM_CONFIG)).get("line_limit")
                if self._watchers:
                    await self._subscribe(client)
            except BaseException:  # not kept half set up (no frame limit, no subscriptions): the next call connects anew
                self._client = None
                await client.close()
                raise
            return client

    async def _connect_or_start(self) -> KsiClient:
        try:
            return await KsiClient(self.socket_path).connect()
        except KsiError as error:
            if self.start_daemon is None or error.code != ErrorCode.DAEMON_UNREACHABLE:
                raise
        try:
            message = await asyncio.to_thread(self.start_daemon)
        except Exception as exc:  # whatever stopped it, the tool call reports it; the server lives on
            raise KsiError(ErrorCode.DAEMON_UNREACHABLE,
                           f"no daemon answers on {self.socket_path} and none could be started: {exc}",
                           socket=self.socket_path) from None
        self.say(message)
        return await KsiClient(self.socket_path).connect()

    def _watched(self) -> set[str]:
        return {name for names, _listener in self._watchers.values() for name in names}

    async def _subscribe(self, client: KsiClient) -> None:
        """One subscription per watched event, so the events watched can grow and shrink."""
        async with self._subscribing:
            for event in sorted(self._watched() - self._subscriptions.keys()):
                reply = await client.request(MONITOR_SUBSCRIBE, {"patterns": [event]})
                self._subscriptions[event] = reply["subscription_id"]

    async def _unsubscribe_unwatched(self) -> None:
        async with self._subscribing:
            client = self._client
            if client is None:
                return
            for event in sorted(self._subscriptions.keys() - self._watched()):
                subscription_id = self._subscriptions.pop(event)
                await client.request(MONITOR_UNSUBSCRIBE, {"subscription_id": subscription_id})

    async def _dispatch(self, client: KsiClient) -> None:
        """Hand pushed events to the watchers; when the connection ends, forget it."""
        async for frame in client.pushes():
            name, data = frame.get("event") or "", frame.get("data") or {}
            for events, listener in list(self._watchers.values()):
                if name in events:
                    try:
                        listener(name, data)
                    except Exception as exc:  # one failing watcher must not deafen the others
                        self.say(f"ksi mcp: a change listener failed: {exc!r}")
        if self._client is client:
            self._client = None
