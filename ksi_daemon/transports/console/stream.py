"""Bus events to a browser as server-sent events: a subscription per open page, freed on close.

Each stream is a `monitor:subscribe` whose origin is a bounded queue. A page that cannot keep
up loses the events that do not fit, and is told how many in the stream itself, so the daemon
never waits on a browser and the page never believes it saw everything when it did not.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson

from ksi_common.events import MONITOR_SUBSCRIBE
from ksi_common.ids import new_id
from ksi_daemon.context import EventContext
from ksi_daemon.transports.http.door import HttpOrigin, RequestHandler

READ_PREFIX = "console-read-"  # correlation ids of the console's own reads (the live view hides them)
KEEPALIVE_SECONDS = 15.0
BATCH = 256  # frames written per wake-up: one write for a burst instead of one per event


def sse(event: str | None, data: Any) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + orjson.dumps(data, default=str) + b"\n\n"


async def take(origin: HttpOrigin, timeout: float) -> list[dict[str, Any]]:
    """Up to BATCH queued frames, waiting at most `timeout` for the first one."""
    try:
        frames = [await asyncio.wait_for(origin.queue.get(), timeout)]
    except TimeoutError:
        return []
    while len(frames) < BATCH and not origin.queue.empty():
        frames.append(origin.queue.get_nowait())
    return frames


async def subscribe(handle_request: RequestHandler, patterns: list[str], queue_size: int
                    ) -> tuple[HttpOrigin, dict[str, Any]]:
    """A queue-backed origin subscribed to `patterns` (the subscription ends when it closes)."""
    origin = HttpOrigin(queue_size)
    context = EventContext.root(correlation_id=new_id(READ_PREFIX), origin=origin)
    try:
        reply = await handle_request(MONITOR_SUBSCRIBE, {"patterns": patterns}, context)
    except BaseException:
        origin.close()
        raise
    return origin, reply


async def event_frames(origin: HttpOrigin, keepalive: float = KEEPALIVE_SECONDS) -> AsyncIterator[bytes]:
    """The stream's body: batches of events, a `dropped` count whenever it grows, keep-alives;
    the subscription is freed when the browser goes away (the body is then closed)."""
    reported = 0
    try:
        yield b"retry: 2000\n\n"
        while True:
            frames = await take(origin, keepalive)
            chunk = b"".join(sse(None, _compact(frame)) for frame in frames)
            if origin.lost != reported:
                reported = origin.lost
                chunk += sse("dropped", {"dropped": reported})
            yield chunk or b": keep-alive\n\n"
    finally:
        origin.close()


def _compact(frame: dict[str, Any]) -> dict[str, Any]:
    context = frame.get("context") or {}
    return {"event": frame.get("event"), "data": frame.get("data"), "event_id": frame.get("event_id"),
            "agent_id": context.get("agent_id"), "correlation_id": context.get("correlation_id"),
            "timestamp": frame.get("timestamp")}
