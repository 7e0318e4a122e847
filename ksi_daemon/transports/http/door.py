"""What every HTTP door shares: calling an event as the router's request, pushed events for a
request's stream, reading a JSON or form body within the limit, and errors in OpenAI's shape."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.ids import new_id
from ksi_daemon.context import INTERNAL, EventContext, Origin
from ksi_daemon.transports.http.body_encoding import decoded
from ksi_daemon.transports.http.errors import error_body, error_headers, status_of

MAX_FORM_FIELDS = 32  # the console's forms have three

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


@dataclass(frozen=True, slots=True)
class RouterCaller:
    """The router as the Caller that submit_and_wait takes: each event an internal request."""

    handle_request: RequestHandler

    async def request(self, event: str, data: dict[str, Any]) -> dict[str, Any]:
        return await call(self.handle_request, event, data)


@dataclass(frozen=True, slots=True)
class OriginCaller:
    """The router as the PushedCaller that follow takes: each event a request from `origin`, whose
    queue holds the events pushed to it (its subscriptions')."""

    handle_request: RequestHandler
    origin: HttpOrigin
    correlation: str = "h-"  # what its requests' correlation ids start with (the console hides its own)

    async def request(self, event: str, data: dict[str, Any]) -> dict[str, Any]:
        context = EventContext.root(correlation_id=new_id(self.correlation), origin=self.origin)
        return await self.handle_request(event, data, context)

    async def next_push(self) -> dict[str, Any] | None:
        # closed only once its stream is abandoned: no push comes after
        return None if self.origin.closed else await self.origin.queue.get()

    def push_ready(self) -> dict[str, Any] | None:
        try:
            return self.origin.queue.get_nowait()
        except asyncio.QueueEmpty:
            return None


def streamed_failure(error: KsiError, request_id: str) -> KsiError:
    """A followed request's failure as its outcome event carries it: completion:wait names the
    request in every failure's details, the event only in a cancel's (the cancel names it itself)."""
    if error.code == ErrorCode.CANCELLED or error.details.get("request_id") != request_id:
        return error
    return KsiError(error.code, error.message, **{k: v for k, v in error.details.items() if k != "request_id"})


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, read no further than `limit` bytes: `payload_too_large` past it (before
    reading at all when the declared length is already past it)."""
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
    return bytes(body)


def _require_type(request: Request, wanted: str) -> None:
    media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media != wanted:
        raise KsiError(ErrorCode.UNSUPPORTED_MEDIA_TYPE, f"send the body as {wanted}",
                       content_type=media or None, expected=wanted)


async def read_json(request: Request, limit: int) -> Any:
    """The request body parsed as JSON; `payload_too_large` past `limit` bytes (sent, and once
    decompressed: see body_encoding), `invalid_json` when unparsable.
    A browser session must say `application/json`: any other type is one a page of another site
    could post without asking the browser first (415 `unsupported_media_type`)."""
    if request.scope.get("ksi.auth") == "session":
        _require_type(request, "application/json")
    body = decoded(await read_body(request, limit), request.headers.get("content-encoding"), limit)
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise KsiError(ErrorCode.INVALID_JSON, "the body is not valid JSON", reason=str(exc)) from None


async def read_form(request: Request, limit: int) -> dict[str, str]:
    """A URL-encoded form within `limit` bytes, read into memory (no multipart, so no file is
    ever spooled to disk); the first value of each field."""
    _require_type(request, "application/x-www-form-urlencoded")
    body = await read_body(request, limit)
    try:
        pairs = parse_qsl(body.decode("utf-8"), keep_blank_values=True, max_num_fields=MAX_FORM_FIELDS)
    except (UnicodeDecodeError, ValueError):
        raise KsiError(ErrorCode.INVALID_REQUEST, "the form is not URL-encoded UTF-8 text") from None
    fields: dict[str, str] = {}
    for name, value in pairs:
        fields.setdefault(name, value)
    return fields


def error_response(error: KsiError) -> Response:
    """A KsiError as OpenAI's error object with its HTTP status (and `Retry-After`, `x-should-retry`)."""
    return JSONResponse(error_body(error), status_code=status_of(error), headers=error_headers(error))
