"""/v1/responses: create (waiting or streamed), retrieve, delete, and a response's input items."""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ksi_common.errors import KsiError
from ksi_daemon.transports.http.door import call
from ksi_daemon.transports.http.openai import shapes
from ksi_daemon.transports.http.openai.lists import list_page
from ksi_daemon.transports.http.openai.runs import Chunk, CompletionStream, Done, complete
from ksi_daemon.transports.http.openai.schemas import ResponseCreate
from ksi_daemon.transports.http.openai.translate import (
    HISTORY_HEADER,
    RESPONSE_FIELDS,
    Door,
    history_used,
    renamed,
    response_payload,
)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class Responses:
    def __init__(self, door: Door) -> None:
        self.door = door

    async def create(self, request: Request) -> Response:
        body: ResponseCreate = await self.door.body(request, ResponseCreate)
        payload = response_payload(body)
        created_at = int(time.time())
        try:
            if body.stream:
                stream = CompletionStream(self.door.handle_request, self.door.background)
                ack = await stream.start(payload)
                return StreamingResponse(self._events(stream, ack, body, created_at),
                                         media_type="text/event-stream", headers=SSE_HEADERS)
            result = await complete(self.door.handle_request, payload)
        except KsiError as error:
            raise renamed(error, RESPONSE_FIELDS) from None
        shaped = self._shape(body, result["response_id"], result["model"], created_at, "completed",
                             text=result["content"], usage=result.get("usage"), conversation_id=result["conversation_id"])
        used = history_used(result)
        if used is None:
            return JSONResponse(shaped)
        shaped["metadata"] = {**(shaped.get("metadata") or {}), "ksi_history": used}
        return JSONResponse(shaped, headers={HISTORY_HEADER: used})

    @staticmethod
    def _shape(body: ResponseCreate, response_id: str, model: str, created_at: int, status: str,
               **fields: Any) -> dict[str, Any]:
        return shapes.response_object(
            response_id, model=model, status=status, created_at=created_at,
            previous_response_id=body.previous_response_id, instructions=body.instructions,
            metadata=body.metadata, temperature=body.temperature, top_p=body.top_p,
            max_output_tokens=body.max_output_tokens, **fields)

    async def _events(self, stream: CompletionStream, ack: dict[str, Any], body: ResponseCreate,
                      created_at: int) -> AsyncIterator[bytes]:
        """The event order the official SDK's `responses.stream()` helper accumulates."""
        sequence = itertools.count()
        response_id, model, conversation_id = ack["response_id"], ack["model"], ack["conversation_id"]
        item_id = f"msg_{response_id}"
        where = {"item_id": item_id, "output_index": 0, "content_index": 0}

        def event(kind: str, **fields: Any) -> bytes:
            data = orjson.dumps({"type": kind, "sequence_number": next(sequence), **fields})
            return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

        def snapshot(status: str, **fields: Any) -> dict[str, Any]:
            return self._shape(body, response_id, model, created_at, status, conversation_id=conversation_id, **fields)

        try:
            yield event("response.created", response=snapshot("in_progress"))
            yield event("response.in_progress", response=snapshot("in_progress"))
            yield event("response.output_item.added", output_index=0,
                        item=shapes.message_item(response_id, "", status="in_progress"))
            yield event("response.content_part.added", **where, part=shapes.output_text(""))
            async for outcome in stream.events():
                if isinstance(outcome, Chunk):
                    if outcome.text:
                        yield event("response.output_text.delta", **where, delta=outcome.text, logprobs=[])
                elif isinstance(outcome, Done):
                    text = str(outcome.result["content"])
                    yield event("response.output_text.done", **where, text=text, logprobs=[])
                    yield event("response.content_part.done", **where, part=shapes.output_text(text))
                    yield event("response.output_item.done", output_index=0,
                                item=shapes.message_item(response_id, text))
                    completed = snapshot("completed", text=text, usage=outcome.result.get("usage"))
                    used = history_used(outcome.result)
                    if used is not None:
                        completed["metadata"] = {**(completed.get("metadata") or {}), "ksi_history": used}
                    yield event("response.completed", response=completed)
                else:
                    error = outcome.error
                    yield event("response.failed", response=snapshot(
                        "failed", error={"code": error.code, "message": error.message}))
        finally:
            stream.abandon()  # the client left early: cancel what is still running

    async def retrieve(self, request: Request) -> Response:
        shown = await call(self.door.handle_request, "response:show", {"response_id": request.path_params["id"]})
        return JSONResponse(shapes.from_record(shown))

    async def delete(self, request: Request) -> Response:
        reply = await call(self.door.handle_request, "response:delete", {"response_id": request.path_params["id"]})
        return JSONResponse({"id": reply["response_id"], "object": "response", "deleted": True})

    async def input_items(self, request: Request) -> Response:
        shown = await call(self.door.handle_request, "response:show", {"response_id": request.path_params["id"]})
        items = shapes.input_items(shown["response_id"], shown.get("inputs") or [])
        return JSONResponse(list_page(items, request))
