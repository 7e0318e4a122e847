"""The Unix-socket server: NDJSON frames in, replies and pushes out. It knows no service."""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import struct
import sys
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, cast

import orjson
import structlog

from ksi_common import wire
from ksi_common.errors import ErrorCode, KsiError
from ksi_common.events import MONITOR_OVERFLOW
from ksi_common.ids import new_id
from ksi_common.timefmt import utc_now
from ksi_daemon import eager
from ksi_daemon.context import EventContext
from ksi_daemon.transports.budget import ConnectionBudget

log = structlog.get_logger("ksi.transport")

RequestHandler = Callable[[str, Any, EventContext], Awaitable[dict[str, Any]]]

_WRITE_HIGH_WATER = 1024 * 1024


def _frame_error(code: ErrorCode, message: str, **details: Any) -> bytes:
    return wire.encode(wire.failure(None, None, KsiError(code, message, **details)))


# orjson reads 1024 levels but writes only 254: a request must stay writable (pushes, logs, files)
MAX_DEPTH = 128


def _deeper_than(value: Any, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(item, dict):
            stack.extend((child, depth + 1) for child in item.values())
        elif isinstance(item, list):
            stack.extend((child, depth + 1) for child in item)
    return False


class Connection(asyncio.Protocol):
    """One client connection: pipelined requests, out-of-order replies, bounded pushes."""

    def __init__(self, server: SocketServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.tasks: set[asyncio.Task[None]] = set()
        self.close_callbacks: list[Callable[[], None]] = []
        self.pending_pushes: deque[bytes] = deque()
        self.lost_pushes = 0
        self.paused_by_writer = False
        self.paused_by_inflight = False
        self.closed = False

    # -- asyncio.Protocol ---------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream transport (uvloop's does not subclass asyncio.Transport, but behaves as one)
        transport = cast(asyncio.Transport, transport)
        self.transport = transport
        transport.set_write_buffer_limits(high=_WRITE_HIGH_WATER)
        if not self.server.peer_allowed(transport):
            transport.write(_frame_error(ErrorCode.INVALID_REQUEST, "connection refused for this uid"))
            transport.close()
            self.closed = True
            return
        if not self.server.budget.take():
            limit = self.server.budget.cap
            transport.write(_frame_error(ErrorCode.TOO_MANY_CONNECTIONS,
                                         f"the daemon serves at most {limit} connections; retry later",
                                         limit=limit, retry_after=1.0))
            transport.close()
            self.closed = True
            return
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self in self.server.connections:
            self.server.connections.discard(self)
            self.server.budget.give_back()
        callbacks, self.close_callbacks = self.close_callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception:
                log.exception("close_callback_failed")

    def pause_writing(self) -> None:
        # The client is not reading: stop reading its requests until it catches up.
        self.paused_by_writer = True
        self._update_reading()

    def resume_writing(self) -> None:
        self.paused_by_writer = False
        while self.pending_pushes and not self.paused_by_writer and self.transport:
            self.transport.write(self.pending_pushes.popleft())
        self._report_lost_pushes()
        self._update_reading()

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self.buffer += data
        self._handle_lines()

    def _handle_lines(self) -> None:
        """Start the complete lines in the buffer; at the in-flight limit the rest wait there."""
        start = 0
        while not self.paused_by_inflight and (end := self.buffer.find(b"\n", start)) >= 0:
            line = bytes(self.buffer[start:end])
            start = end + 1
            if len(line) > self.server.line_limit:
                self._too_large()
                return
            if line.strip():
                self._handle_line(line)
        if start:
            del self.buffer[:start]
        # only the line still arriving counts against the limit, not complete ones that wait
        if len(self.buffer) - (self.buffer.rfind(b"\n") + 1) > self.server.line_limit:
            self._too_large()

    def eof_received(self) -> bool:
        # A half line left at EOF is dropped: the client went away mid-request.
        self.buffer.clear()
        return False

    # -- requests -----------------------------------------------------------
    def _too_large(self) -> None:
        self.write(_frame_error(
            ErrorCode.PAYLOAD_TOO_LARGE,
            f"line exceeds the limit of {self.server.line_limit} bytes",
            limit=self.server.line_limit,
        ))
        self.buffer.clear()
        self.closed = True
        if self.transport:
            self.transport.close()

    def _handle_line(self, line: bytes) -> None:
        try:
            frame = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            message = "line is not valid UTF-8" if "utf-8" in str(exc).lower() else "line is not valid JSON"
            self.write(_frame_error(ErrorCode.INVALID_JSON, message, reason=str(exc)))
            return
        if not isinstance(frame, dict):
            self.write(_frame_error(ErrorCode.INVALID_REQUEST, "a request must be a JSON object"))
            return
        correlation_id = frame.get("correlation_id")
        if correlation_id is None:
            correlation_id = new_id("d-")
        elif not isinstance(correlation_id, str):
            correlation_id = str(correlation_id)
        event = frame.get("event")
        if not isinstance(event, str) or not event:
            self.write(wire.encode(wire.failure(None, correlation_id, KsiError(
                ErrorCode.INVALID_REQUEST, "`event` must be a non-empty string", fields={"event": "required string"}))))
            return
        data = frame.get("data", {})
        if data is None:
            data = {}
        if not isinstance(data, dict):
            self.write(wire.encode(wire.failure(event, correlation_id, KsiError(
                ErrorCode.INVALID_REQUEST, "`data` must be a JSON object", fields={"data": "must be an object"}))))
            return
        # counting brackets is cheap; only a line with that many of them is walked
        if line.count(b"{") + line.count(b"[") > MAX_DEPTH and _deeper_than(data, MAX_DEPTH):
            self.write(wire.encode(wire.failure(event, correlation_id, KsiError(
                ErrorCode.INVALID_REQUEST, f"`data` nests deeper than {MAX_DEPTH} levels",
                fields={"data": f"at most {MAX_DEPTH} levels of nesting"}, limit=MAX_DEPTH))))
            return
        context = EventContext.root(correlation_id=correlation_id, origin=self)
        task = self._start(self._serve(event, data, correlation_id, context))
        if task is None:
            return  # answered already
        self.tasks.add(task)
        task.add_done_callback(self._task_done)
        if len(self.tasks) >= self.server.max_inflight:
            self.paused_by_inflight = True
            self._update_reading()

    @staticmethod
    def _start(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
        """Run `coro` in a new task whose first step runs now; None when that step finished it.
        A request that needs no waiting (health, help, every error reply, ...) is then answered
        in the loop iteration that read it."""
        started = eager.start(coro)
        return None if started.finished else started.task

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if self.paused_by_inflight and len(self.tasks) < self.server.max_inflight and not self.closed:
            self.paused_by_inflight = False
            self._handle_lines()  # lines read before the pause go first (and may pause again)
            self._update_reading()

    async def _serve(self, event: str, data: dict[str, Any], correlation_id: str, context: EventContext) -> None:
        try:
            result = await self.server.handle_request(event, data, context)
            reply = wire.success(event, correlation_id, result)
        except KsiError as error:
            reply = wire.failure(event, correlation_id, error)
        except asyncio.CancelledError:
            reply = wire.failure(event, correlation_id, KsiError(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down"))
        except Exception:
            log.exception("handler_failed", event_name=event, correlation_id=correlation_id)
            reply = wire.failure(event, correlation_id, KsiError(ErrorCode.INTERNAL_ERROR, "internal error; see the daemon log"))
        self.write(wire.encode(reply))

    def _update_reading(self) -> None:
        if self.transport is None or self.closed:
            return
        if self.paused_by_writer or self.paused_by_inflight:
            self.transport.pause_reading()
        else:
            self.transport.resume_reading()

    # -- output -------------------------------------------------------------
    def write(self, payload: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(payload)

    def push(self, frame: dict[str, Any]) -> None:
        """Queue a pushed event; when the client is not reading, keep a bounded backlog."""
        if self.closed or self.transport is None:
            return
        payload = wire.encode(frame)
        if not self.paused_by_writer:
            self.transport.write(payload)
            return
        if len(self.pending_pushes) >= self.server.push_queue_size:
            self.lost_pushes += 1
            return
        self.pending_pushes.append(payload)

    def _report_lost_pushes(self) -> None:
        if self.lost_pushes and self.transport:
            lost, self.lost_pushes = self.lost_pushes, 0
            self.transport.write(wire.encode({
                "event": MONITOR_OVERFLOW, "push": True, "data": {"lost_events": lost},
                "timestamp": utc_now(),
            }))

    def on_close(self, callback: Callable[[], None]) -> Callable[[], None]:
        self.close_callbacks.append(callback)
        return lambda: self.close_callbacks.remove(callback) if callback in self.close_callbacks else None


# the bytes a Unix socket's path may have (sun_path, its closing NUL left out)
SOCKET_PATH_LIMIT = 107 if sys.platform.startswith("linux") else 103


class SocketPathTooLong(ValueError):
    """A socket path longer than a Unix socket address can hold: refused before anything is made."""


class SocketServer:
    """Listens on a Unix socket (0600 in a 0700 directory) and hands requests to the router."""

    def __init__(
        self,
        path: Path,
        handle_request: RequestHandler,
        *,
        line_limit: int,
        push_queue_size: int,
        max_inflight: int,
        allow_uids: list[int],
        budget: ConnectionBudget,
    ) -> None:
        size = len(os.fsencode(path))
        if size > SOCKET_PATH_LIMIT:
            raise SocketPathTooLong(f"the socket path {path} is {size} bytes long; a Unix socket's path holds at "
                                    f"most {SOCKET_PATH_LIMIT}: choose a shorter --socket (or KSI_SOCKET_PATH)")
        self.path = path
        self.handle_request = handle_request
        self.line_limit = line_limit
        self.push_queue_size = push_queue_size
        self.max_inflight = max_inflight
        self.allowed_uids = {os.getuid(), *allow_uids}
        self.budget = budget  # shared with the HTTP front: one cap on every door's connections
        self.connections: set[Connection] = set()
        self._server: asyncio.AbstractServer | None = None

    def peer_allowed(self, transport: asyncio.Transport) -> bool:
        sock = transport.get_extra_info("socket")
        if sock is None or not hasattr(socket, "SO_PEERCRED"):
            return True
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        if uid in self.allowed_uids:
            return True
        log.warning("peer_refused", uid=uid)
        return False

    async def start(self) -> None:
        # A directory we create is private; one that exists (a shared one named by --socket) is
        # not ours to change: the socket file itself is 0600 and peers are checked by uid.
        if not self.path.parent.exists():
            self.path.parent.mkdir(parents=True, mode=0o700)
            os.chmod(self.path.parent, 0o700)
        if os.path.lexists(self.path):
            raise OSError(errno.EEXIST, "the socket path is taken", str(self.path))
        old_umask = os.umask(0o177)
        try:
            self._server = await asyncio.get_running_loop().create_unix_server(
                lambda: Connection(self), path=str(self.path), backlog=self.budget.backlog
            )
        finally:
            os.umask(old_umask)
        os.chmod(self.path, 0o600)

    def stop_accepting(self) -> None:
        if self._server is not None:
            self._server.close()

    async def drain(self, timeout: float) -> None:
        """Wait for in-flight requests up to `timeout`, then cancel what is left."""
        tasks = {task for conn in self.connections for task in conn.tasks}
        if tasks:
            _done, pending = await asyncio.wait(tasks, timeout=timeout)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)

    async def close(self) -> None:
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()
        if self._server is not None:
            try:
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
            except TimeoutError:
                pass
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
