"""The HTTP front: route groups composed into one Starlette app behind token auth, served by
uvicorn as a task on the daemon's own event loop (no thread, no extra process)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable, Generator, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import structlog
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, get_route_path

from ksi_common import http_token
from ksi_common.errors import ErrorCode, KsiError
from ksi_common.settings import Settings
from ksi_daemon.transports.budget import ConnectionBudget
from ksi_daemon.transports.http.auth import BrowserSessions, TokenAuth
from ksi_daemon.transports.http.binding import HttpBindFailed, HttpBinding, UnsafeHttpBind
from ksi_daemon.transports.http.connections import budgeted_protocol, budgeted_ws_protocol
from ksi_daemon.transports.http.door import error_response

log = structlog.get_logger("ksi.http")


@dataclass(frozen=True, slots=True)
class RouteGroup:
    """One door's routes and mounts, with what must run while they are served (e.g. MCP's session manager)."""

    routes: Sequence[BaseRoute]
    lifespan: Callable[[], AbstractAsyncContextManager[Any]] | None = field(default=None)


class _DaemonLoopServer(uvicorn.Server):
    """uvicorn on a loop it does not own: the daemon keeps its signal handlers, and start() learns
    when the listener is up."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self.ready.set()


async def _ksi_error(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, KsiError)
    return error_response(exc)


async def _http_error(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: ErrorCode.NOT_FOUND, 405: ErrorCode.METHOD_NOT_ALLOWED}.get(exc.status_code, ErrorCode.INVALID_REQUEST)
    response = error_response(KsiError(code, str(exc.detail)))
    response.status_code = exc.status_code
    return response


async def _internal_error(request: Request, _exc: Exception) -> Response:
    # the route's path: the session prefix before it is what keeps the cookie from other ports
    log.exception("http_handler_failed", path=get_route_path(request.scope))
    return error_response(KsiError(ErrorCode.INTERNAL_ERROR, "internal error; see the daemon log"))


class HttpFront:
    """Start, serve, stop: the daemon's HTTP listener for every HTTP door."""

    def __init__(self, settings: Settings, groups: Sequence[RouteGroup], sessions: BrowserSessions,
                 budget: ConnectionBudget) -> None:
        self.settings = settings
        self.sessions = sessions
        self.budget = budget  # shared with the Unix socket: one cap on every door's connections
        self.binding = HttpBinding.parse(settings.http_addr or "")
        if not self.binding.loopback and settings.http_token is None:
            raise UnsafeHttpBind(
                f"refusing to serve HTTP on {self.binding.host} without an explicit token: set KSI_HTTP_TOKEN "
                "(or bind to 127.0.0.1)"
            )
        self.groups = list(groups)
        self.token = ""
        self.app = Starlette(
            routes=[route for group in self.groups for route in group.routes],
            exception_handlers={KsiError: _ksi_error, HTTPException: _http_error, Exception: _internal_error},
        )
        self._server: _DaemonLoopServer | None = None
        self._task: asyncio.Task[None] | None = None
        self._lifespans = AsyncExitStack()
        self.port = self.binding.port

    @property
    def url(self) -> str:
        host = f"[{self.binding.host}]" if ":" in self.binding.host else self.binding.host
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        """Resolve the token (TokenFileError when it cannot be written), enter the groups' lifespans,
        bind, and return once requests are served."""
        explicit = self.settings.http_token
        self.token = explicit.get_secret_value() if explicit else http_token.load_or_create(self.settings.layout)
        for group in self.groups:
            if group.lifespan is not None:
                await self._lifespans.enter_async_context(group.lifespan())
        family = socket.AF_INET6 if ":" in self.binding.host else socket.AF_INET
        try:
            sock = socket.create_server((self.binding.host, self.binding.port), family=family,
                                        backlog=self.budget.backlog)
        except OSError as exc:
            await self._lifespans.aclose()
            raise HttpBindFailed(f"cannot serve HTTP on {self.url}: {exc.strerror or exc}") from None
        # Accepted sockets inherit this. asyncio sets it only on sockets whose proto is IPPROTO_TCP,
        # and create_server's is 0: without it a keep-alive response's body waited ~40 ms for an ACK.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.port = sock.getsockname()[1]
        guarded = TokenAuth(self.app, self.token, self.sessions, self.port, self.binding.loopback)
        config = uvicorn.Config(
            guarded, lifespan="off", log_config=None,
            # a frame is one small event, mostly to a client on this machine: compressing each cost
            # ~0.09 ms of CPU (8 frames a tool turn), for bandwidth loopback does not lack
            ws=budgeted_ws_protocol(self.budget), ws_max_size=self.settings.line_limit, ws_per_message_deflate=False,
            log_level="warning", access_log=False, server_header=False, date_header=False,
            timeout_graceful_shutdown=max(self.settings.shutdown_timeout, 0.1),
            http=budgeted_protocol(self.budget, self.settings.http_head_timeout, self.settings.http_body_timeout),
            backlog=self.budget.backlog,
            timeout_keep_alive=self.settings.http_keepalive_timeout,  # type: ignore[arg-type]  # a float works
        )
        self._server = _DaemonLoopServer(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        ready = asyncio.ensure_future(self._server.ready.wait())
        await asyncio.wait({self._task, ready}, return_when=asyncio.FIRST_COMPLETED)
        if self._task.done():
            ready.cancel()
            sock.close()
            self._task.result()  # the startup error, if any
            raise RuntimeError("the HTTP front stopped while starting")
        log.info("http_started", url=self.url)

    async def stop(self) -> None:
        """Stop accepting, let requests in flight finish within the shutdown timeout, then leave the lifespans."""
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            try:
                await asyncio.wait_for(asyncio.shield(self._task), self.settings.shutdown_timeout + 2.0)
            except (TimeoutError, Exception):
                log.exception("http_stop_failed")
                self._task.cancel()
        self._server = None
        self._task = None
        await self._lifespans.aclose()

