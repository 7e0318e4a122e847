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
from ksi_daemon.transports.http.openai import shapes, tool_shapes
from ksi_daemon.transports.http.openai.lists import list_page
from ksi_daemon.transports.http.openai.runs import Chunk, CompletionStream, Done, complete
from ksi_daemon.transports.http.openai.schemas import ResponseCreate
from ksi_daemon.transports.http.openai.translate import RESPONSE_FIELDS, Door, renamed, response_payload

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
                             text=result["content"], usage=result.get("usage"),
                             conversation_id=result["conversation_id"])
        return JSONResponse(tool_shapes.with_output(shaped, result["response_id"], result.get("output")))

    @staticmethod
    def _shape(body: ResponseCreate, response_id: str, model: str, created_at: int, status: str,
               **fields: Any) -> dict[str, Any]:
        shaped = shapes.response_object(
            response_id, model=model, status=status, created_at=created_at,
            previous_response_id=body.previous_response_id, instructions=body.instructions,
            metadata=body.metadata, temperature=body.temperature, top_p=body.top_p,
            max_output_tokens=body.max_output_tokens, **fields)
        return {**shaped, **tool_shapes.request_echo(body)}

    async def _events(self, stream: CompletionStream, ack: dict[str, Any], body: ResponseCreate,
                      created_at: int) -> AsyncIterator[bytes]:
        """The event order the official SDK's `responses.stream()` helper accumulates."""
        sequence = itertools.count()
        response_id, model, conversation_id = ack["response_id"], ack["model"], ack["conversation_id"]
        items = tool_shapes.ResponseItemEvents(response_id)

        def event(kind: str, **fields: Any) -> bytes:
            data = orjson.dumps({"type": kind, "sequence_number": next(sequence), **fields})
            return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

        def snapshot(status: str, **fields: Any) -> dict[str, Any]:
            return self._shape(body, response_id, model, created_at, status, conversation_id=conversation_id, **fields)

        try:
            yield event("response.created", response=snapshot("in_progress"))
            yield event("response.in_progress", response=snapshot("in_progress"))
            async for outcome in stream.events():
                if isinstance(outcome, Chunk):
                    if outcome.text:
                        for kind, fields in items.text_delta(outcome.text):
                            yield event(kind, **fields)
                    if outcome.tool_call is not None:
                        for kind, fields in items.call_delta(outcome.tool_call):
                            yield event(kind, **fields)
                elif isinstance(outcome, Done):
                    closing, output = items.done(outcome.result)
                    for kind, fields in closing:
                        yield event(kind, **fields)
                    yield event("response.completed", response={**snapshot(
                        "completed", text=str(outcome.result["content"]), usage=outcome.result.get("usage")),
                        "output": output})
                else:
                    error = outcome.error
                    yield event("response.failed", response=snapshot(
                        "failed", error={"code": error.code, "message": error.message}))
        finally:
            stream.abandon()  # the client left early: cancel what is still running

    async def retrieve(self, request: Request) -> Response:
        shown = await call(self.door.handle_request, "response:show", {"response_id": request.path_params["id"]})
        return JSONResponse(tool_shapes.with_output(shapes.from_record(shown), shown["response_id"],
                                                    tool_shapes.stored_output(shown)))

    async def delete(self, request: Request) -> Response:
        reply = await call(self.door.handle_request, "response:delete", {"response_id": request.path_params["id"]})
        return JSONResponse({"id": reply["response_id"], "object": "response", "deleted": True})

    async def input_items(self, request: Request) -> Response:
        shown = await call(self.door.handle_request, "response:show", {"response_id": request.path_params["id"]})
        items = tool_shapes.input_items(shown["response_id"], shown.get("inputs") or [])
        return JSONResponse(list_page(items, request))
