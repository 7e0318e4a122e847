"""The MCP door at /mcp: the same tools and resources as `ksi mcp`, over streamable HTTP, behind
the front's bearer token. Its `Caller` sends events straight to the daemon's router. SSE events
carry ids, and a client whose stream dropped resumes it with `Last-Event-ID`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from mcp.server.streamable_http_manager import StreamableHTTPASGIApp, StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from starlette.routing import Route

from ksi_common.events import MONITOR_SUBSCRIBE
from ksi_common.settings import Settings
from ksi_daemon.transports.http.binding import HttpBinding
from ksi_daemon.transports.http.door import RequestHandler, call
from ksi_daemon.transports.http.front import RouteGroup
from ksi_daemon.transports.http.mcp_events import SessionEventStore, SessionScoped
from ksi_mcp.caller import EventListener, StopWatching
from ksi_mcp.server import KsiMcp

LOOPBACK_HOSTS = ["127.0.0.1:*", "localhost:*", "[::1]:*"]
RETRY_MS = 1000  # the SSE `retry` a client waits before resuming a dropped stream


class ListenerOrigin:
    """An `Origin` whose pushed events go straight to a listener, until it is closed."""

    def __init__(self, listener: EventListener) -> None:
        self.listener = listener
        self._callbacks: list[Callable[[], None]] = []

    def push(self, frame: dict[str, Any]) -> None:
        self.listener(frame.get("event") or "", frame.get("data") or {})

    def on_close(self, callback: Callable[[], None]) -> Callable[[], None]:
        self._callbacks.append(callback)
        return lambda: self._callbacks.remove(callback) if callback in self._callbacks else None

    def close(self) -> None:
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()  # ends the monitor subscription


class RouterCaller:
    """The MCP tools' `Caller` inside the daemon: each event is a request to the router."""

    def __init__(self, handle_request: RequestHandler) -> None:
        self.handle_request = handle_request

    async def request(self, event: str, data: dict[str, Any]) -> dict[str, Any]:
        return await call(self.handle_request, event, data)

    async def watch(self, events: tuple[str, ...], listener: EventListener) -> StopWatching:
        origin = ListenerOrigin(listener)
        await call(self.handle_request, MONITOR_SUBSCRIBE, {"patterns": list(events)}, origin=origin)

        async def stop() -> None:
            origin.close()

        return stop


def mcp_routes(handle_request: RequestHandler, settings: Settings) -> RouteGroup:
    """POST/GET/DELETE /mcp for the daemon to compose into its HTTP front."""
    app = KsiMcp(RouterCaller(handle_request))  # relative `files` resolve as the daemon resolves them
    security = None
    if HttpBinding.parse(settings.http_addr or "").loopback:
        # The token already guards every request; this also refuses DNS-rebound Host headers.
        security = TransportSecuritySettings(
            enable_dns_rebinding_protection=True, allowed_hosts=LOOPBACK_HOSTS,
            allowed_origins=[f"http://{host}" for host in LOOPBACK_HOSTS])
    manager = StreamableHTTPSessionManager(app=app.server, security_settings=security,
                                           max_request_body_size=settings.line_limit,
                                           event_store=SessionEventStore(), retry_interval=RETRY_MS)

    @asynccontextmanager
    async def serving() -> AsyncIterator[None]:
        # The manager's task group must be left by the task that entered it, and the daemon may
        # stop from another task than the one that started it: the manager gets a task of its own.
        running, stopping = asyncio.Event(), asyncio.Event()

        async def run() -> None:
            async with manager.run():
                running.set()
                await stopping.wait()

        task = asyncio.get_running_loop().create_task(run())
        started = asyncio.ensure_future(running.wait())
        await asyncio.wait({task, started}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            started.cancel()
            task.result()  # the manager's start-up error
        try:
            yield
        finally:
            stopping.set()
            await task
            await app.close()

    return RouteGroup([Route("/mcp", endpoint=SessionScoped(StreamableHTTPASGIApp(manager)))], lifespan=serving)
