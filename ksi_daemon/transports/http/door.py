"""What every HTTP door shares: calling an event as the router's request, pushed events for a
request's stream, reading a JSON body within the limit, and errors in OpenAI's shape."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.ids import new_id
from ksi_daemon.context import INTERNAL, EventContext, Origin
from ksi_daemon.transports.http.errors import error_body, retry_after, status_of

# the daemon's request function (Daemon._handle_request): event, data, context -> reply data
RequestHandler = Callable[[str, Any, EventContext], Awaitable[dict[str, Any]]]


class HttpOrigin:
    """The origin of one HTTP request: pushed events queue up for its response stream, and
    closing it (the request ended or the client left) ends what was tied to it, such as
    subscriptions. The queue is bounded: overflow is counted, never blocking the daemon."""

    def __init__(self, limit: int = 1000) -> None:
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(limit)
        self.lost = 0
        self.closed = False
        self._callbacks: list[Callable[[], None]] = []

    def push(self, frame: dict[str, Any]) -> None:
        if self.closed:
            return
        try:
            self.queue.put_nowait(frame)
        except asyncio.QueueFull:
            self.lost += 1

    def on_close(self, callback: Callable[[], None]) -> Callable[[], None]:
        self._callbacks.append(callback)
        return lambda: self._callbacks.remove(callback) if callback in self._callbacks else None

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    async def __aenter__(self) -> HttpOrigin:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        self.close()


def new_context(origin: Origin = INTERNAL) -> EventContext:
    """A root context for one HTTP request (correlation ids `h-...` tell HTTP requests apart in logs)."""
    return EventContext.root(correlation_id=new_id("h-"), origin=origin)


async def call(handle_request: RequestHandler, event: str, data: dict[str, Any],
               origin: Origin = INTERNAL) -> dict[str, Any]:
    """Send one event to the router as a request; the reply data, or the KsiError it raised."""
    return await handle_request(event, data, new_context(origin))


async def read_json(request: Request, limit: int) -> Any:
    """The request body parsed as JSON; `payload_too_large` past `limit` bytes, `invalid_json` when unparsable."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise KsiError(ErrorCode.PAYLOAD_TOO_LARGE, f"the body exceeds the limit of {limit} bytes", limit=limit)
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise KsiError(ErrorCode.PAYLOAD_TOO_LARGE, f"the body exceeds the limit of {limit} bytes",
                               limit=limit)
    except ClientDisconnect:
        raise KsiError(ErrorCode.INVALID_REQUEST, "the client went away while sending the body") from None
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise KsiError(ErrorCode.INVALID_JSON, "the body is not valid JSON", reason=str(exc)) from None


def error_response(error: KsiError) -> Response:
    """A KsiError as OpenAI's error object with its HTTP status (and `Retry-After` when it has one)."""
    headers = {}
    if (seconds := retry_after(error)) is not None:
        headers["Retry-After"] = seconds
    return JSONResponse(error_body(error), status_code=status_of(error), headers=headers)
