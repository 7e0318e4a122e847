"""The /v1 route table; each handler validates, calls events, and shapes the reply."""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from ksi_common.settings import Settings
from ksi_daemon.transports.http.door import RequestHandler, call


class OpenAIDoor:
    def __init__(self, handle_request: RequestHandler, settings: Settings) -> None:
        self.handle_request = handle_request
        self.settings = settings

    async def models(self, _request: Request) -> Response:
        """Configured models, saved consortia and agents, in OpenAI's model list shape."""
        now = int(time.time())
        names = [self.settings.default_model, "echo/default"]
        names += [pattern for pattern in self.settings.models if not any(c in pattern for c in "*?[")]
        consortia = await call(self.handle_request, "consortium:list", {})
        names += [entry["model"] for entry in consortia["consortia"]]
        agents = await call(self.handle_request, "agent:list", {"status": "active"})
        names += [f"agent/{entry['agent_id']}" for entry in agents["agents"]]
        data: list[dict[str, Any]] = [
            {"id": name, "object": "model", "created": now, "owned_by": "ksi"} for name in dict.fromkeys(names)
        ]
        return JSONResponse({"object": "list", "data": data})


def build_routes(handle_request: RequestHandler, settings: Settings) -> list[BaseRoute]:
    door = OpenAIDoor(handle_request, settings)
    return [
        Route("/v1/models", door.models, methods=["GET"]),
    ]
