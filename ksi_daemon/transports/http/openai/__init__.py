"""The OpenAI-compatible door under /v1: Responses, Conversations, Chat Completions and Models,
each handler translating HTTP to KSI events and back."""

from __future__ import annotations

from ksi_common.settings import Settings
from ksi_daemon.transports.http.door import RequestHandler
from ksi_daemon.transports.http.front import RouteGroup
from ksi_daemon.transports.http.openai.routes import build_routes


def openai_routes(handle_request: RequestHandler, settings: Settings) -> RouteGroup:
    """The /v1 routes and /openapi.json, for the daemon to compose into its HTTP front."""
    return RouteGroup(build_routes(handle_request, settings))
