"""WebSocket mode of /v1/responses: a client keeps one socket open and sends `response.create`
frames, one response at a time; each is answered with the same events the SSE stream sends, as
text frames. The frames become the Responses door's own events (see responses.py): this module
holds only what is the connection's: responses made with `store: false` and `generate: false`
warm-ups, chainable on this socket only, and the ordering of its turns."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import orjson
import structlog
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketDisconnected

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.ids import new_response_id
from ksi_daemon.transports.http.errors import error_body, status_of
from ksi_daemon.transports.http.openai import tool_shapes
from ksi_daemon.transports.http.openai.compaction import unfold
from ksi_daemon.transports.http.openai.connection_local import LocalResponses
from ksi_daemon.transports.http.openai.response_object import ksi_id, response_object
from ksi_daemon.transports.http.openai.responses import Responses, asked_of, submitted
from ksi_daemon.transports.http.openai.runs import CompletionStream
from ksi_daemon.transports.http.openai.schemas import ResponseCreate, parse
from ksi_daemon.transports.http.openai.translate import RESPONSE_FIELDS, dropped_tools, new_input_positions, renamed

log = structlog.get_logger("ksi.http")

CREATE = "response.create"
# Codex tells the server it has read a response; nothing in KSI waits for that, so it is taken silently
PROCESSED = "response.processed"
# connection-local responses one socket may chain from, the oldest forgotten first; warm-ups hold
# their whole request in memory, so fewer of them (a client warms up the turn it is about to send)
HELD_PER_CONNECTION = 1_000
WARM_UPS_PER_CONNECTION = 8
# frames one socket may send ahead of the turn that runs (turns run one at a time): past this the
# client is not waiting for answers, and its socket is closed rather than its frames kept
WAITING_FRAMES = 64


@dataclass(slots=True)
class WarmUp:
    """A `generate: false` request: its fields, replayed under the next request that chains from it."""

    fields: dict[str, Any]


@dataclass(slots=True)
class Connection:
    """What one socket holds: the connection-local responses it may chain from (None for a
    `store: false` response, whose exchange the daemon holds; a WarmUp for a warm-up)."""

    local: LocalResponses
    held: OrderedDict[str, WarmUp | None] = field(default_factory=OrderedDict)
    warm_ups: int = 0

    def hold(self, response_id: str, warm_up: WarmUp | None = None) -> None:
        self.local.add(response_id)
        self.held[response_id] = warm_up
        self.warm_ups += warm_up is not None
        if self.warm_ups > WARM_UPS_PER_CONNECTION:
            self._forget(next(key for key, held in self.held.items() if held is not None))
        if len(self.held) > HELD_PER_CONNECTION:
            self._forget(next(iter(self.held)))

    def _forget(self, response_id: str) -> None:
        if self.held.pop(response_id, None) is not None:
            self.warm_ups -= 1

    def evict(self, response_id: str | None) -> None:
        """A continuation from `response_id` failed: it is no longer held here (OpenAI's rule)."""
        if response_id is not None:
            self._forget(ksi_id(response_id))

    def resolved(self, fields: dict[str, Any]) -> dict[str, Any]:
        """The request fields with a warm-up it chains from replayed under them; a
        connection-local id this socket does not hold is previous_response_not_found."""
        previous = fields.get("previous_response_id")
        if not isinstance(previous, str):
            return fields
        key = ksi_id(previous)
        if key not in self.held:
            if key in self.local:
                raise self.local.refuse(previous, "this connection does not hold it (another made it, or a failed "
                                                  "continuation evicted it)")
            return fields  # a stored response: the daemon resolves it
        warm_up = self.held[key]
        if warm_up is None:
            return fields
        merged = {**warm_up.fields, **{k: v for k, v in fields.items() if k != "input"}}
        merged["input"] = _items(warm_up.fields.get("input")) + _items(fields.get("input"))
        merged.pop("previous_response_id", None)
        if warm_up.fields.get("previous_response_id") is not None:
            merged["previous_response_id"] = warm_up.fields["previous_response_id"]
        return merged


def _items(value: Any) -> list[Any]:
    """A request's `input` as a list of items (text is one user message)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return list(value) if isinstance(value, list) else [value]


def error_frame(error: KsiError) -> dict[str, Any]:
    """A refused request as the WebSocket `error` event: its HTTP status and OpenAI's error object."""
    return {"type": "error", "status": status_of(error), **error_body(error)}


class ResponsesSocket:
    """The WebSocket route of /v1/responses."""

    def __init__(self, responses: Responses) -> None:
        self.responses = responses
        self.local = responses.local

    async def serve(self, websocket: WebSocket) -> None:
        """Read frames while the turns they ask for run one after another; a socket that closes
        cancels the turn it was waiting for."""
        await websocket.accept()
        connection = Connection(self.local)
        frames: asyncio.Queue[str | bytes] = asyncio.Queue()
        worker = asyncio.get_running_loop().create_task(self._turns(websocket, connection, frames))
        try:
            while True:
                message = await websocket.receive()
                if message["type"] == "websocket.disconnect":
                    return
                if frames.qsize() >= WAITING_FRAMES:
                    await websocket.close(1013, f"more than {WAITING_FRAMES} frames wait for their turn")
                    return
                frames.put_nowait(message["text"] if message.get("text") is not None else message.get("bytes") or b"")
        except WebSocketDisconnect:
            return
        finally:
            worker.cancel()  # a turn in flight ends with its stream, which cancels the completion
            with contextlib.suppress(asyncio.CancelledError):
                await worker

    async def _turns(self, websocket: WebSocket, connection: Connection, frames: asyncio.Queue[str | bytes]) -> None:
        while True:
            frame = await frames.get()
            try:
                await self._answer(websocket, connection, frame)
            except (WebSocketDisconnect, WebSocketDisconnected):
                return  # the socket closed while a frame was sent: the reader ends the connection

    async def _answer(self, websocket: WebSocket, connection: Connection, frame: str | bytes) -> None:
        """One frame's turn; a refusal or a fault is an error frame, and the socket goes on."""
        previous = None
        try:
            fields = _frame_fields(frame)
            if fields is None:
                return
            previous = fields.get("previous_response_id")
            await self._turn(websocket, connection, fields)
        except KsiError as error:
            connection.evict(previous if isinstance(previous, str) else None)
            await _send(websocket, error_frame(error))
        except (WebSocketDisconnect, WebSocketDisconnected):
            raise
        except Exception:
            log.exception("websocket_turn_failed")
            await _send(websocket, error_frame(KsiError(ErrorCode.INTERNAL_ERROR, "internal error; see the daemon log")))

    async def _turn(self, websocket: WebSocket, connection: Connection, fields: dict[str, Any]) -> None:
        generate = fields.pop("generate", True)
        if not isinstance(generate, bool):
            raise KsiError(ErrorCode.VALIDATION_ERROR, "invalid request: generate: true or false",
                           fields={"generate": "true or false"})
        fields.pop("stream", None)  # every response on a socket streams: the field has nothing to choose
        if fields.get("background"):
            raise KsiError(ErrorCode.UNSUPPORTED_PARAMETER, "background is not supported on a WebSocket: a response "
                           "runs while its socket is open", fields={"background": "not on a WebSocket"})
        chained_from = fields.get("previous_response_id")
        unfolded = unfold(connection.resolved(fields))
        fields = unfolded.fields
        compaction = self.responses.compaction
        if unfolded.trigger:  # answered by a compaction item alone: no model call, nothing stored
            async for event in compaction.trigger_events(unfolded):
                await _send(websocket, event)
            return
        if generate is False:
            await self._warm_up(websocket, connection, fields)
            return
        body: ResponseCreate = parse(ResponseCreate, {**fields, "stream": True})
        stream = CompletionStream(self.responses.door.handle_request, self.responses.door.background)
        dropped = dropped_tools(body, self.responses.door.settings)

        async def start(payload: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
            return await stream.start(payload), payload

        try:
            ack, payload = await submitted(body, dropped, start)
        except KsiError as error:
            raise renamed(error, RESPONSE_FIELDS, new_input_positions(body)) from None
        ended = "response.failed"
        events = self.responses.stream_events(stream, ack, asked_of(body, payload),
                                              tool_shapes.request_echo(body, dropped), int(time.time()))
        async with contextlib.aclosing(compaction.crossed(events, unfolded.threshold)) as shown:
            async for event in shown:  # a socket that closes cancels this turn: its stream ends at once
                await _send(websocket, event)
                ended = event["type"]
        if ended == "response.failed":
            connection.evict(chained_from)
        elif not body.store:
            connection.hold(ack["response_id"])

    async def _warm_up(self, websocket: WebSocket, connection: Connection, fields: dict[str, Any]) -> None:
        """`generate: false`: no model is called; the request is checked as a real one would be and
        held on this socket under a new response id, which a later request chains from."""
        check = {**fields, "input": fields.get("input") or "warm-up"}  # a warm-up may carry no input yet
        body: ResponseCreate = parse(ResponseCreate, check)
        model = body.model or self.responses.door.settings.default_model
        response_id = new_response_id(model)
        connection.hold(response_id, WarmUp(fields))
        created_at = int(time.time())
        asked = asked_of(body, {})
        opened = response_object(response_id, asked, model=model, status="in_progress", created_at=created_at)
        await _send(websocket, {"type": "response.created", "sequence_number": 0, "response": opened})
        done = response_object(response_id, asked, model=model, status="completed", created_at=created_at,
                               usage={"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0})
        await _send(websocket, {"type": "response.completed", "sequence_number": 1, "response": done})


def _frame_fields(frame: str | bytes) -> dict[str, Any] | None:
    """The request fields of a `response.create` frame; None for a frame that asks for no answer."""
    try:
        data = orjson.loads(frame)
    except orjson.JSONDecodeError as exc:
        raise KsiError(ErrorCode.INVALID_JSON, "the frame is not valid JSON", reason=str(exc)) from None
    if not isinstance(data, dict):
        raise KsiError(ErrorCode.INVALID_REQUEST, "a frame must be a JSON object", fields={"type": "missing"})
    kind = data.pop("type", None)
    if kind == PROCESSED:
        return None
    if kind != CREATE:
        raise KsiError(ErrorCode.INVALID_REQUEST, f"unknown frame type {kind!r}: send {CREATE!r}",
                       fields={"type": f"must be {CREATE!r}"})
    return data


async def _send(websocket: WebSocket, event: dict[str, Any]) -> None:
    await websocket.send_text(orjson.dumps(event).decode())
