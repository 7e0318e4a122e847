"""/v1/responses: create (waiting, streamed, or in the background), retrieve (or resume a background
response's stream), cancel, delete, and a response's input items. Ids are shown as `resp_` and the
KSI response id; either form is taken."""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.events import COMPLETION_ASYNC, COMPLETION_CANCEL, COMPLETION_CHUNKS, RESPONSE_DELETE, RESPONSE_SHOW
from ksi_common.request_status import FINISHED
from ksi_daemon.transports.http.door import call, read_json
from ksi_daemon.transports.http.openai import shapes, tool_shapes
from ksi_daemon.transports.http.openai.compaction import Checkpoint, Compaction, unfold
from ksi_daemon.transports.http.openai.connection_local import LocalResponses
from ksi_daemon.transports.http.openai.lists import list_page
from ksi_daemon.transports.http.openai.response_object import (
    Asked,
    from_chunks,
    from_record,
    ksi_id,
    public_id,
    response_error,
    response_object,
)
from ksi_daemon.transports.http.openai.response_stream import (
    FINAL_EVENTS,
    ResponseEvents,
    chunks_before,
    last_sequence,
    sse,
)
from ksi_daemon.transports.http.openai.runs import Chunk, CompletionStream, Done, complete
from ksi_daemon.transports.http.openai.schemas import ResponseCreate, parse
from ksi_daemon.transports.http.openai.translate import (
    HISTORY_HEADER,
    RESPONSE_FIELDS,
    Door,
    continued_response,
    dropped_tools,
    history_used,
    new_input_positions,
    renamed,
    response_payload,
)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
POLL_SLICE = 15.0  # seconds one completion:chunks waits for more of a background response
T = TypeVar("T")


async def submitted(body: ResponseCreate, dropped: frozenset[str],
                    submit: Callable[[dict[str, Any]], Awaitable[T]]) -> T:
    """`submit` called with the body as completion:async data, less the `dropped` hosted tools. A
    history whose last output item carries this door's id continues after that response; when the
    id names no stored response, the history is matched instead (see continued_response)."""
    after = continued_response(body)
    if after is not None:
        try:
            return await submit(response_payload(body, after, dropped))
        except KsiError as error:
            if error.code != ErrorCode.PREVIOUS_RESPONSE_NOT_FOUND:
                raise
    return await submit(response_payload(body, dropped=dropped))


def asked_of(body: ResponseCreate, payload: dict[str, Any]) -> Asked:
    return Asked(options=dict(payload.get("options") or {}), temperature=body.temperature,
                 max_output_tokens=body.max_output_tokens, instructions=body.instructions,
                 metadata=dict(body.metadata or {}), previous_response_id=body.previous_response_id,
                 background=body.background, store=body.store, truncation=body.truncation or "auto",
                 reasoning_summary=body.reasoning.summary or body.reasoning.generate_summary if body.reasoning else None,
                 encrypted_reasoning="reasoning.encrypted_content" in (body.include or ()))


def _starting_after(request: Request) -> int:
    raw = request.query_params.get("starting_after")
    if raw is None:
        return -1  # from the first event
    if not raw.isdigit():
        raise KsiError(ErrorCode.VALIDATION_ERROR, "starting_after must be a sequence number (0 or more)",
                       fields={"starting_after": "an integer, 0 or more"})
    return int(raw)


class Responses:
    def __init__(self, door: Door) -> None:
        self.door = door
        self.compaction = Compaction(door)
        self.local = LocalResponses()  # shared with the WebSocket route: see connection_local

    async def create(self, request: Request) -> Response:
        unfolded = unfold(await read_json(request, self.door.settings.line_limit))
        if isinstance(unfolded.fields, dict):
            self.local.check(unfolded.fields.get("previous_response_id"))
        if unfolded.trigger:  # answered by a compaction item alone: no model call, nothing stored
            return await self.compaction.answer_trigger(unfolded)
        body: ResponseCreate = parse(ResponseCreate, unfolded.fields)
        dropped = dropped_tools(body, self.door.settings)
        return await submitted(body, dropped,
                               lambda payload: self._create(body, payload, dropped, unfolded.threshold))

    async def _create(self, body: ResponseCreate, payload: dict[str, Any], dropped: frozenset[str],
                      threshold: int | None) -> Response:
        asked = asked_of(body, payload)
        echo = tool_shapes.request_echo(body, dropped)
        created_at = int(time.time())
        try:
            if body.background and threshold is not None:
                raise KsiError(ErrorCode.UNSUPPORTED_PARAMETER, "context_management is not supported with "
                               "background: compact the response once it ended (POST /v1/responses/compact)",
                               fields={"context_management": "not with background"})
            if body.background:  # runs in the daemon whatever this client does; its chunks are kept
                ack = await call(self.door.handle_request, COMPLETION_ASYNC, {**payload, "background": True})
                if body.stream:
                    return await self._resume(ack["response_id"], -1)
                return JSONResponse(response_object(ack["response_id"], asked, model=ack["model"], status="queued",
                                                    created_at=created_at, conversation_id=ack["conversation_id"]))
            if body.stream:
                stream = CompletionStream(self.door.handle_request, self.door.background)
                ack = await stream.start(payload)
                return StreamingResponse(self._events(stream, ack, asked, echo, created_at, threshold),
                                         media_type="text/event-stream", headers=SSE_HEADERS)
            result = await complete(self.door.handle_request, payload)
        except KsiError as error:
            raise renamed(error, {**RESPONSE_FIELDS, **tool_shapes.search_field(body)},
                          new_input_positions(body)) from None
        shaped = response_object(
            result["response_id"], asked, model=result["model"], status="completed", created_at=created_at,
            text=result["content"], usage=result.get("usage"), conversation_id=result["conversation_id"],
            finish_reason=result.get("finish_reason"))
        shaped = tool_shapes.with_output({**shaped, **echo}, result["response_id"], result.get("output"),
                                         asked.encrypted_reasoning)
        if await self.compaction.due(result["response_id"], (shaped.get("usage") or {}).get("input_tokens", 0),
                                     threshold):
            after = await self.compaction.item(Checkpoint(result["response_id"]))
            shaped["output"] = [*shaped["output"], after]
        used = history_used(result)
        if used is None:
            return JSONResponse(shaped)
        shaped["metadata"] = {**(shaped.get("metadata") or {}), "ksi_history": used}
        return JSONResponse(shaped, headers={HISTORY_HEADER: used})

    async def _events(self, stream: CompletionStream, ack: dict[str, Any], asked: Asked, echo: dict[str, Any],
                      created_at: int, threshold: int | None) -> AsyncIterator[bytes]:
        events = self.compaction.crossed(self.stream_events(stream, ack, asked, echo, created_at), threshold)
        async with contextlib.aclosing(events):  # a client that leaves ends the stream at once
            async for event in events:
                yield sse(event)

    async def stream_events(self, stream: CompletionStream, ack: dict[str, Any], asked: Asked, echo: dict[str, Any],
                            created_at: int) -> AsyncGenerator[dict[str, Any], None]:
        """A foreground stream's events (SSE or WebSocket frames): followed through pushed events; a
        client that leaves cancels it. Its events are numbered as they are sent (only a background
        one is read again, from its kept chunks: see _replayed); an output item opens when its first
        delta arrives."""
        response_id, model, conversation_id = ack["response_id"], ack["model"], ack["conversation_id"]
        items = tool_shapes.ResponseItemEvents(response_id, asked.encrypted_reasoning)
        sequence = itertools.count()

        def event(kind: str, **fields: Any) -> dict[str, Any]:
            return {"type": kind, "sequence_number": next(sequence), **fields}

        def snapshot(status: str, **fields: Any) -> dict[str, Any]:
            return {**response_object(response_id, asked, model=model, status=status, created_at=created_at,
                                      conversation_id=conversation_id, **fields), **echo}

        try:
            yield event("response.created", response=snapshot("in_progress"))
            yield event("response.in_progress", response=snapshot("in_progress"))
            async for outcome in stream.events():
                if isinstance(outcome, Chunk):
                    for kind, fields in items.reasoning_delta((outcome.reasoning or {}).get("text") or ""):
                        yield event(kind, **fields)
                    if outcome.text:
                        for kind, fields in items.text_delta(outcome.text):
                            yield event(kind, **fields)
                    if outcome.tool_call is not None:
                        for kind, fields in items.call_delta(outcome.tool_call):
                            yield event(kind, **fields)
                    continue
                if isinstance(outcome, Done):
                    result = outcome.result
                    closing, output = items.done(result)
                    for kind, fields in closing:
                        yield event(kind, **fields)
                    final = {**snapshot("completed", text=str(result["content"]), usage=result.get("usage"),
                                        finish_reason=result.get("finish_reason")), "output": output}
                    used = history_used(result)
                    if used is not None:  # which history the model was sent: the client's or the stored one
                        final["metadata"] = {**(final.get("metadata") or {}), "ksi_history": used}
                else:
                    error = outcome.error
                    cancelled = error.code == ErrorCode.CANCELLED
                    final = snapshot("cancelled" if cancelled else "failed",
                                     error=None if cancelled else response_error(error.code, error.message))
                yield event(FINAL_EVENTS.get(final["status"], "response.failed"), response=final)
        finally:
            stream.abandon()  # the client left early: cancel what is still running

    async def _chunks(self, response_id: str, after: int = -1, wait: float = 0.0) -> dict[str, Any]:
        return await call(self.door.handle_request, COMPLETION_CHUNKS,
                          {"response_id": response_id, "after": after, "wait": wait})

    async def _kept(self, response_id: str) -> dict[str, Any] | None:
        """A background response's chunks and state, or None when none are kept for it (a
        foreground response, or one that ended minutes ago); an unknown id is response_not_found."""
        try:
            return await self._chunks(response_id)
        except KsiError as error:
            if error.code != ErrorCode.RESPONSE_NOT_FOUND:
                raise
        await call(self.door.handle_request, RESPONSE_SHOW, {"response_id": response_id})
        return None

    async def _resume(self, response_id: str, starting_after: int) -> Response:
        """A background response's stream from the event after `starting_after` (-1: from its start)."""
        view = await self._kept(response_id)
        if view is None:
            raise KsiError(ErrorCode.STREAM_NOT_FOUND,
                           f"the stream of response {response_id} is not kept: only a background response's "
                           "stream is, while it runs and for some minutes after", response_id=response_id)
        if view["status"] in FINISHED:
            last = last_sequence(view["total_chunks"], view["status"] == "done")
            if starting_after > last:
                raise KsiError(ErrorCode.STARTING_AFTER_OUT_OF_RANGE,
                               f"starting_after {starting_after} is beyond the stream of response {response_id}, "
                               f"whose last event is {last}", fields={"starting_after": f"at most {last}"},
                               last_sequence_number=last)
        return StreamingResponse(self._replayed(view, starting_after), media_type="text/event-stream",
                                 headers=SSE_HEADERS)

    async def _replayed(self, view: dict[str, Any], starting_after: int) -> AsyncIterator[bytes]:
        """The events of a background response numbered from its kept chunks, those after
        `starting_after` sent. Leaving changes nothing: the response runs on."""
        response_id = view["response_id"]
        numbering = ResponseEvents(response_id)
        start = {**view, "chunks": [], "result": None, "error": None}  # the response as it began
        opening = numbering.opening(from_chunks({**start, "status": "queued" if view["status"] == "queued" else "running"}),
                                    from_chunks({**start, "status": "running"}))
        for event in opening:
            if event["sequence_number"] > starting_after:
                yield sse(event)
        seen = chunks_before(starting_after)  # chunks the client has
        if seen:
            view = await self._chunks(response_id, after=seen - 1)
        while True:
            for offset, text in enumerate(view["chunks"]):
                yield sse(numbering.delta(view["first"] + offset, text))
            seen = view["first"] + len(view["chunks"])
            if view["status"] in FINISHED:
                for event in numbering.closing(view["total_chunks"], from_chunks(view)):
                    if event["sequence_number"] > starting_after:
                        yield sse(event)
                return
            view = await self._chunks(response_id, after=seen - 1, wait=POLL_SLICE)

    async def retrieve(self, request: Request) -> Response:
        response_id = ksi_id(request.path_params["id"])
        if request.query_params.get("stream", "false").lower() == "true":
            return await self._resume(response_id, _starting_after(request))
        view = await self._kept(response_id)
        if view is not None:
            output = (view.get("result") or {}).get("output")
            return JSONResponse(tool_shapes.with_output(from_chunks(view), response_id, output))
        shown = await call(self.door.handle_request, RESPONSE_SHOW, {"response_id": response_id})
        return JSONResponse(tool_shapes.with_output(from_record(shown), response_id, tool_shapes.stored_output(shown)))

    async def cancel(self, request: Request) -> Response:
        """Cancel a background response that is queued or running; any other is refused."""
        response_id = ksi_id(request.path_params["id"])
        view = await self._kept(response_id)
        if view is not None and view["status"] not in FINISHED:
            await call(self.door.handle_request, COMPLETION_CANCEL, {"request_id": view["request_id"]})
            view = await self._chunks(response_id)
            if view["status"] == "cancelled":
                return JSONResponse(from_chunks(view))
        status = view["status"] if view is not None else "ended"
        raise KsiError(ErrorCode.RESPONSE_NOT_CANCELLABLE,
                       f"response {response_id} has ended ({status}): only a background response that is queued "
                       "or running can be cancelled", response_id=response_id, status=status)

    async def delete(self, request: Request) -> Response:
        reply = await call(self.door.handle_request, RESPONSE_DELETE,
                           {"response_id": ksi_id(request.path_params["id"])})
        return JSONResponse({"id": public_id(reply["response_id"]), "object": "response", "deleted": True})

    async def input_items(self, request: Request) -> Response:
        shown = await call(self.door.handle_request, RESPONSE_SHOW,
                           {"response_id": ksi_id(request.path_params["id"])})
        items = shapes.input_items(shown["response_id"], shown.get("inputs") or [])
        return JSONResponse(list_page(items, request))
