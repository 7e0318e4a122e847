"""The /v1 route table: each handler validates, calls events, and shapes the reply."""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route, WebSocketRoute

from ksi_common.events import AGENT_LIST, COMPLETION_MODELS, CONSORTIUM_LIST
from ksi_common.settings import Settings
from ksi_daemon.transports.http.door import RequestHandler, call
from ksi_daemon.transports.http.openai.chat import ChatCompletions
from ksi_daemon.transports.http.openai.conversations import Conversations
from ksi_daemon.transports.http.openai.openapi import openapi_document
from ksi_daemon.transports.http.openai.responses import Responses
from ksi_daemon.transports.http.openai.translate import AGENT_PREFIX, Door
from ksi_daemon.transports.http.openai.websocket import ResponsesSocket


class Models:
    def __init__(self, door: Door) -> None:
        self.door = door

    async def list(self, _request: Request) -> Response:
        """Configured models, saved consortia and active agents, in OpenAI's model list shape."""
        names = list((await call(self.door.handle_request, COMPLETION_MODELS, {}))["models"])
        consortia = await call(self.door.handle_request, CONSORTIUM_LIST, {})
        names += [entry["model"] for entry in consortia["consortia"]]
        agents = await call(self.door.handle_request, AGENT_LIST, {"status": "active"})
        names += [f"{AGENT_PREFIX}{entry['agent_id']}" for entry in agents["agents"]]
        now = int(time.time())
        data: list[dict[str, Any]] = [
            {"id": name, "object": "model", "created": now, "owned_by": "ksi"} for name in dict.fromkeys(names)
        ]
        return JSONResponse({"object": "list", "data": data})


def build_routes(handle_request: RequestHandler, settings: Settings) -> list[BaseRoute]:
    door = Door(handle_request, settings)
    responses, chat, conversations, models = Responses(door), ChatCompletions(door), Conversations(door), Models(door)
    document = openapi_document()

    async def openapi(_request: Request) -> Response:
        return JSONResponse(document)

    return [
        Route("/openapi.json", openapi, methods=["GET"]),
        Route("/v1/models", models.list, methods=["GET"]),
        Route("/v1/responses", responses.create, methods=["POST"]),
        WebSocketRoute("/v1/responses", ResponsesSocket(responses).serve),
        Route("/v1/responses/compact", responses.compaction.compact, methods=["POST"]),
        Route("/v1/responses/{id}", responses.retrieve, methods=["GET"]),
        Route("/v1/responses/{id}", responses.delete, methods=["DELETE"]),
        Route("/v1/responses/{id}/input_items", responses.input_items, methods=["GET"]),
        Route("/v1/responses/{id}/cancel", responses.cancel, methods=["POST"]),
        Route("/v1/chat/completions", chat.create, methods=["POST"]),
        Route("/v1/conversations", conversations.create, methods=["POST"]),
        Route("/v1/conversations/{id}", conversations.retrieve, methods=["GET"]),
        Route("/v1/conversations/{id}", conversations.update, methods=["POST"]),
        Route("/v1/conversations/{id}", conversations.delete, methods=["DELETE"]),
        Route("/v1/conversations/{id}/items", conversations.list_items, methods=["GET"]),
        Route("/v1/conversations/{id}/items", conversations.add_items, methods=["POST"]),
    ]
