"""A blocking client of the daemon's socket for callers without an event loop (the `llm` plugin).

Unlike `oneshot`, one connection carries several requests, and pushed events of a subscription
made on it can be read between their replies. Standard library and orjson only.
"""

from __future__ import annotations

import itertools
import socket
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ksi_common import wire
from ksi_common.errors import ErrorCode, KsiError


class SyncClient:
    """One blocking connection; replies are matched by correlation id, pushes are kept in order."""

    def __init__(self, socket_path: str | Path, timeout: float | None = 30.0) -> None:
        self.socket_path = str(socket_path)
        self.timeout = timeout  # seconds any single read or write may block
        self._sock: socket.socket | None = None
        self._reader: Any = None
        self._ids = itertools.count(1)
        self._pushes: deque[dict[str, Any]] = deque()

    def connect(self) -> SyncClient:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except OSError as exc:
            sock.close()
            raise KsiError(
                ErrorCode.DAEMON_UNREACHABLE,
                f"cannot reach the daemon at {self.socket_path}: {exc.strerror or exc}",
                socket=self.socket_path,
            ) from None
        self._sock, self._reader = sock, sock.makefile("rb")
        return self

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
        if self._sock is not None:
            self._sock.close()
        self._sock = self._reader = None

    def __enter__(self) -> SyncClient:
        return self.connect()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def send(self, event: str, data: dict[str, Any] | None = None) -> str:
        """Write a request without waiting; returns its correlation id."""
        if self._sock is None:
            raise KsiError(ErrorCode.DAEMON_UNREACHABLE, "client is not connected")
        correlation_id = f"s-{next(self._ids)}"
        try:
            self._sock.sendall(wire.encode({"event": event, "data": data or {}, "correlation_id": correlation_id}))
        except TimeoutError:
            raise KsiError(ErrorCode.TIMEOUT, f"the daemon did not take a request within {self.timeout}s") from None
        except OSError as exc:
            raise KsiError(ErrorCode.DAEMON_UNREACHABLE, f"connection to the daemon failed: {exc}") from None
        return correlation_id

    def _read(self, timeout: float | None) -> dict[str, Any]:
        assert self._sock is not None
        self._sock.settimeout(timeout)
        try:
            line = self._reader.readline()
        except TimeoutError:
            raise KsiError(ErrorCode.TIMEOUT, f"no word from the daemon within {timeout}s") from None
        except OSError as exc:
            raise KsiError(ErrorCode.DAEMON_UNREACHABLE, f"connection to the daemon failed: {exc}") from None
        if not line.endswith(b"\n"):
            raise KsiError(ErrorCode.DAEMON_UNREACHABLE, "the daemon closed the connection")
        return wire.decode(line)

    def frames(self, timeout: float | None = None) -> Iterator[dict[str, Any]]:
        """Every frame in arrival order (pushes kept while awaiting a reply come first)."""
        while True:
            yield self._pushes.popleft() if self._pushes else self._read(timeout or self.timeout)

    def request_frame(self, event: str, data: dict[str, Any] | None = None,
                      timeout: float | None = None) -> dict[str, Any]:
        """Send a request and return its whole reply frame; pushes meanwhile are kept for `frames`."""
        correlation_id = self.send(event, data)
        while True:
            frame = self._read(timeout or self.timeout)
            if frame.get("push"):
                self._pushes.append(frame)
            elif frame.get("correlation_id") in (correlation_id, None):
                return frame

    def request(self, event: str, data: dict[str, Any] | None = None, timeout: float | None = None) -> dict[str, Any]:
        """Send a request and return its data, raising `KsiError` on a failure reply."""
        frame = self.request_frame(event, data, timeout)
        if "error" in frame:
            raise KsiError.from_wire(frame["error"])
        return frame.get("data") or {}
