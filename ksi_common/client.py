"""A small async client of the daemon's socket: correlated requests and pushed events."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from ksi_common import wire
from ksi_common.errors import ErrorCode, KsiError

LINE_LIMIT = 64 * 1024 * 1024


class KsiClient:
    """One connection; many requests may be in flight on it at once."""

    def __init__(self, socket_path: str | Path, frame_limit: int | None = None) -> None:
        self.socket_path = str(socket_path)
        # The daemon's line limit: it closes the connection on a longer frame, failing every
        # request in flight on it, so a longer one is refused here without being sent.
        self.frame_limit = frame_limit
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._pending: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._pushes: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self._ids = itertools.count(1)
        self._reading: asyncio.Task[None] | None = None

    async def connect(self) -> KsiClient:
        try:
            self._reader, self._writer = await asyncio.open_unix_connection(
                self.socket_path, limit=LINE_LIMIT
            )
        except (FileNotFoundError, ConnectionRefusedError, OSError) as exc:
            raise KsiError(
                ErrorCode.DAEMON_UNREACHABLE,
                f"cannot reach the daemon at {self.socket_path}: {exc.strerror or exc}",
                socket=self.socket_path,
            ) from None
        self._reading = asyncio.create_task(self._read_loop())
        return self

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            try:
                await self._writer.wait_closed()
            except OSError:
                pass
        if self._reading is not None:
            await asyncio.gather(self._reading, return_exceptions=True)

    async def __aenter__(self) -> KsiClient:
        return await self.connect()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _read_loop(self) -> None:
        assert self._reader is not None
        try:
            while line := await self._reader.readline():
                frame = wire.decode(line)
                if frame.get("push"):
                    self._pushes.put_nowait(frame)
                    continue
                future = self._pending.pop(frame.get("correlation_id") or "", None)
                if future is not None and not future.done():
                    future.set_result(frame)
        except (ConnectionError, ValueError, asyncio.IncompleteReadError):
            pass
        finally:
            lost = KsiError(ErrorCode.DAEMON_UNREACHABLE, "connection to the daemon closed")
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(lost)
            self._pending.clear()
            self._pushes.put_nowait(None)

    async def send_frame(self, event: str, data: dict[str, Any] | None = None) -> dict[str, Any]:
        """Send a request and return the whole reply frame (success or failure)."""
        if self._writer is None:
            raise KsiError(ErrorCode.DAEMON_UNREACHABLE, "client is not connected")
        correlation_id = f"c-{next(self._ids)}"
        line = wire.encode({"event": event, "data": data or {}, "correlation_id": correlation_id})
        if self.frame_limit is not None and len(line) - 1 > self.frame_limit:
            raise KsiError(ErrorCode.PAYLOAD_TOO_LARGE,
                           f"{event}: the request is {len(line) - 1} bytes, over the daemon's limit of "
                           f"{self.frame_limit} bytes", limit=self.frame_limit, size=len(line) - 1)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[correlation_id] = future
        try:
            self._writer.write(line)
            await self._writer.drain()
        except (ConnectionError, OSError) as exc:  # the daemon went away (a restart): say so, no traceback
            self._pending.pop(correlation_id, None)
            raise KsiError(ErrorCode.DAEMON_UNREACHABLE, f"connection to the daemon lost: {exc}") from None
        return await future

    async def request(self, event: str, data: dict[str, Any] | None = None) -> dict[str, Any]:
        """Send a request and return its data, raising `KsiError` on a failure reply."""
        reply = await self.send_frame(event, data)
        if "error" in reply:
            raise KsiError.from_wire(reply["error"])
        return reply.get("data") or {}

    async def pushes(self) -> AsyncIterator[dict[str, Any]]:
        """Pushed event frames as they arrive, until the connection closes."""
        while (frame := await self._pushes.get()) is not None:
            yield frame

    async def next_push(self, timeout: float | None = None) -> dict[str, Any] | None:
        frame = await asyncio.wait_for(self._pushes.get(), timeout)
        if frame is None:
            self._pushes.put_nowait(None)
        return frame

    def push_ready(self) -> dict[str, Any] | None:
        """A frame already pushed, taken without waiting; None when none is (or the connection closed)."""
        try:
            frame = self._pushes.get_nowait()
        except asyncio.QueueEmpty:
            return None
        if frame is None:
            self._pushes.put_nowait(None)
        return frame
