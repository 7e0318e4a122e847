"""A blocking one-request client: what `ksi send` needs, without asyncio's start-up cost."""

from __future__ import annotations

import socket
import uuid
from pathlib import Path
from typing import Any

from ksi_common import wire
from ksi_common.errors import ErrorCode, KsiError


def request_frame(
    socket_path: str | Path, event: str, data: dict[str, Any], timeout: float | None = None
) -> dict[str, Any]:
    """Send one request and return its whole reply frame; pushes on the way are skipped."""
    correlation_id = f"cli-{uuid.uuid4().hex[:8]}"
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
