"""The Messages door's routes: create a Message (waited for or streamed), count a request's tokens,
and list models in Anthropic's shape for a client that says `anthropic-version`. Every error is
answered in Anthropic's shape."""

from __future__ import annotations

import base64
import binascii
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from ksi_common.errors import KsiError
from ksi_common.events import COMPLETION_MODELS
from ksi_common.items import item_text
from ksi_common.pdf_pages import TOKENS_PER_PAGE, page_count
from ksi_common.settings import Settings
from ksi_daemon.transports.http.anthropic.blocks import invalid, pdf_payloads, system_text
from ksi_daemon.transports.http.anthropic.errors import error_response, sse_error
from ksi_daemon.transports.http.anthropic.schemas import CountTokens, MessagesCreate
from ksi_daemon.transports.http.anthropic.shapes import MessageEvents, message_object, sse
from ksi_daemon.transports.http.anthropic.translate import (
    in_block_terms,
    in_client_terms,
    messages_payload,
    split_turns,
    tool_fields,
    unsent_fields,
)
from ksi_daemon.transports.http.door import RequestHandler, call
from ksi_daemon.transports.http.front import RouteGroup
from ksi_daemon.transports.http.openai.responses import SSE_HEADERS
from ksi_daemon.transports.http.openai.routes import Models
from ksi_daemon.transports.http.openai.runs import Chunk, CompletionStream, Done, complete
from ksi_daemon.transports.http.openai.translate import HISTORY_HEADER, Door, history_used

CONVERSATION_HEADER = "x-ksi-conversation-id"
VERSION_HEADER = "anthropic-version"
BETA_HEADER = "anthropic-beta"  # comma-separated names, possibly over several header lines
UNSENT_HEADER = "x-ksi-unsent"  # request fields this answer's provider could not take (see unsent_fields)
Handler = Callable[[Request], Awaitable[Response]]


def in_anthropic_shape(handler: Handler, only_when_asked: bool = False) -> Handler:
    """`handler` whose KsiErrors are answered in Anthropic's error shape (`only_when_asked`: for a
    client that says `anthropic-version`; others get the OpenAI door's shape)."""
    async def handle(request: Request) -> Response:
        try:
            return await handler(request)
        except KsiError as error:
            if only_when_asked and VERSION_HEADER not in request.headers:
                raise
            return error_response(in_client_terms(error))

    return handle


def beta_names(lines: list[str]) -> list[str]:
    return [name.strip() for line in lines for name in line.split(",") if name.strip()]


class Messages:
    def __init__(self, door: Door) -> None:
        self.door = door

    async def create(self, request: Request) -> Response:
        body: MessagesCreate = await self.door.body(request, MessagesCreate)
        conversation_id = request.headers.get(CONVERSATION_HEADER)
        turns = split_turns(body, continuing=conversation_id is not None)
        payload = messages_payload(body, turns, self.door.settings, conversation_id,
                                   beta_names(request.headers.getlist(BETA_HEADER)))
        unsent = unsent_fields(body, self.door.settings.aliased(body.model))
        noted = {UNSENT_HEADER: ",".join(unsent)} if unsent else {}
        try:
            if body.stream:
                stream = CompletionStream(self.door.handle_request, self.door.background)
                ack = await stream.start(payload)
                return StreamingResponse(self._events(stream, ack, body.model), media_type="text/event-stream",
                                         headers={**SSE_HEADERS, CONVERSATION_HEADER: ack["conversation_id"],
                                                  "request-id": ack["response_id"], **noted})
            result = await complete(self.door.handle_request, payload)
        except KsiError as error:
            raise in_block_terms(error, turns) from None
        headers = {CONVERSATION_HEADER: result["conversation_id"], "request-id": result["response_id"], **noted}
        used = history_used(result)
        if used is not None:
            headers[HISTORY_HEADER] = used
        return JSONResponse(message_object(result, body.model), headers=headers)

    async def _events(self, stream: CompletionStream, ack: dict[str, Any], model: str) -> AsyncIterator[bytes]:
        events = MessageEvents(f"msg_{ack['response_id']}", model)
        try:
            for event in events.start():
                yield sse(event)
            async for outcome in stream.events():
                if isinstance(outcome, Chunk):
                    pieces = list(events.reasoning(outcome.reasoning)) if outcome.reasoning else []
                    pieces += events.text(outcome.text) if outcome.text else []
                    if outcome.tool_call is not None:
                        pieces += events.call(outcome.tool_call)
                    for event in pieces:
                        yield sse(event)
                elif isinstance(outcome, Done):
                    for event in events.done(outcome.result):
                        yield sse(event)
                else:
                    yield sse_error(outcome.error)
        finally:
            stream.abandon()

    async def count_tokens(self, request: Request) -> Response:
        """The request's input tokens, estimated as the daemon estimates them before a provider
        counts them (about four characters a token, a PDF by its pages): no provider is called,
        nothing is written."""
        body: CountTokens = await self.door.body(request, CountTokens)
        checked = MessagesCreate.model_validate({**body.model_dump(exclude_none=True), "max_tokens": 1})
        turns = split_turns(checked, continuing=True)
        texts = [system_text(body.system) or "", *(item_text(item) for item in turns.history + turns.new)]
        texts += [str(tool) for tool in tool_fields(checked).get("tools", [])]
        characters = sum(len(text) for text in texts)
        pdfs = sum(page_count(_decoded(data, where)) * TOKENS_PER_PAGE
                   for where, data in pdf_payloads([message.content for message in checked.messages]))
        return JSONResponse({"input_tokens": max(1, math.ceil(characters / 4)) + pdfs})


def _decoded(data: str, where: str) -> bytes:
    """A PDF's bytes, to count its pages (a create checks them whole, in the daemon)."""
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise invalid(where, "not valid base64") from None


class AnthropicModels:
    """`GET /v1/models` in Anthropic's shape when the client says `anthropic-version`, else OpenAI's."""

    def __init__(self, door: Door) -> None:
        self.openai = Models(door)
        self.door = door

    async def list(self, request: Request) -> Response:
        if VERSION_HEADER not in request.headers:
            return await self.openai.list(request)
        names = list((await call(self.door.handle_request, COMPLETION_MODELS, {}))["models"])
        names += [alias for alias in self.door.settings.model_aliases if not any(c in alias for c in "*?[")]
        data = [self._model(name) for name in dict.fromkeys(names)]
        return JSONResponse({"data": data, "has_more": False, "first_id": data[0]["id"] if data else None,
                             "last_id": data[-1]["id"] if data else None})

    async def retrieve(self, request: Request) -> Response:
        return JSONResponse(self._model(request.path_params["model_id"]))

    @staticmethod
    def _model(name: str) -> dict[str, Any]:
        created = datetime.fromtimestamp(int(time.time()), UTC).isoformat().replace("+00:00", "Z")
        return {"type": "model", "id": name, "display_name": name, "created_at": created}


def build_routes(handle_request: RequestHandler, settings: Settings) -> list[BaseRoute]:
    door = Door(handle_request, settings)
    messages, models = Messages(door), AnthropicModels(door)
    return [
        Route("/v1/messages", in_anthropic_shape(messages.create), methods=["POST"]),
        Route("/v1/messages/count_tokens", in_anthropic_shape(messages.count_tokens), methods=["POST"]),
        Route("/v1/models", in_anthropic_shape(models.list, only_when_asked=True), methods=["GET"]),
        Route("/v1/models/{model_id:path}", in_anthropic_shape(models.retrieve), methods=["GET"]),
    ]





def messages_routes(handle_request: RequestHandler, settings: Settings) -> RouteGroup:
    """The Messages routes, composed before the OpenAI door's (its /v1/models answers both shapes)."""
    return RouteGroup(build_routes(handle_request, settings))
