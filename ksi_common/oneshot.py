"""A blocking one-request client: what `ksi send` needs, without asyncio's start-up cost."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

from ksi_common import wire
from ksi_common.errors import ErrorCode, KsiError
from ksi_common.ids import new_id


def request_frame(
    socket_path: str | Path, event: str, data: dict[str, Any], timeout: float | None = None
) -> dict[str, Any]:
    """Send one request and return its whole reply frame; pushes on the way are skipped."""
    correlation_id = new_id("cli-", 8)
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        sock.connect(str(socket_path))
    except (FileNotFoundError, ConnectionRefusedError, OSError) as exc:
        raise KsiError(
            ErrorCode.DAEMON_UNREACHABLE,
            f"cannot reach the daemon at {socket_path}: {exc.strerror or exc}",
            socket=str(socket_path),
        ) from None
    with sock:
        try:
            sock.sendall(wire.encode({"event": event, "data": data, "correlation_id": correlation_id}))
            buffer = b""
            while True:
                chunk = sock.recv(1 << 16)
                if not chunk:
                    raise KsiError(ErrorCode.DAEMON_UNREACHABLE, "the daemon closed the connection")
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    frame = wire.decode(line)
                    if frame.get("correlation_id") in (correlation_id, None) and not frame.get("push"):
                        return frame
        except TimeoutError:
            raise KsiError(ErrorCode.TIMEOUT, f"no reply from the daemon within {timeout}s") from None
        except OSError as exc:
            raise KsiError(ErrorCode.DAEMON_UNREACHABLE, f"connection failed: {exc}") from None


def request(socket_path: str | Path, event: str, data: dict[str, Any] | None = None,
            timeout: float | None = None) -> dict[str, Any]:
    """Send one request and return its data, raising `KsiError` on a failure reply."""
    frame = request_frame(socket_path, event, data or {}, timeout)
    if "error" in frame:
        raise KsiError.from_wire(frame["error"])
    return frame.get("data") or {}


class Connection:
    """A blocking connection for a few requests in turn; pushed events met on the way are kept.

    What `ksi ask` needs to stream without asyncio: subscribe, send, then read chunks and the
    final reply from the same socket as they come."""

    def __init__(self, socket_path: str | Path, timeout: float | None = None) -> None:
        self.socket_path = str(socket_path)
        self.pushes: list[dict[str, Any]] = []
        self._buffer = b""
        try:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._sock.settimeout(timeout)
            self._sock.connect(self.socket_path)
        except OSError as exc:
            raise KsiError(ErrorCode.DAEMON_UNREACHABLE,
                           f"cannot reach the daemon at {socket_path}: {exc.strerror or exc}",
                           socket=self.socket_path) from None

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._sock.close()

    def send(self, event: str, data: dict[str, Any]) -> str:
        """Send a request without waiting; returns its correlation id."""
        correlation_id = new_id("cli-", 8)
        try:
            self._sock.sendall(wire.encode({"event": event, "data": data, "correlation_id": correlation_id}))
        except OSError as exc:
            raise KsiError(ErrorCode.DAEMON_UNREACHABLE, f"connection failed: {exc}") from None
        return correlation_id

    def read_frame(self) -> dict[str, Any]:
        """The next frame from the daemon, push or reply, as soon as its line is complete."""
        while b"\n" not in self._buffer:
            try:
                chunk = self._sock.recv(1 << 16)
            except TimeoutError:
                raise KsiError(ErrorCode.TIMEOUT, "no reply from the daemon in time") from None
            except OSError as exc:
                raise KsiError(ErrorCode.DAEMON_UNREACHABLE, f"connection failed: {exc}") from None
            if not chunk:
                raise KsiError(ErrorCode.DAEMON_UNREACHABLE, "the daemon closed the connection")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return wire.decode(line)

    def reply(self, correlation_id: str) -> dict[str, Any]:
        """Read until the reply to `correlation_id`, keeping pushes; its data, or KsiError."""
        while True:
            frame = self.read_frame()
            if frame.get("push"):
                self.pushes.append(frame)
            elif frame.get("correlation_id") in (correlation_id, None):
                if "error" in frame:
                    raise KsiError.from_wire(frame["error"])
                return frame.get("data") or {}

    def request(self, event: str, data: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.reply(self.send(event, data or {}))
