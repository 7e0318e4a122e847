"""The console's pages and streams: each handler calls events and renders what they answer.

Pages render on the server (Jinja2, every value escaped); the only script on them adds live
parts: the event stream, a streamed answer, lazy "what was sent" panels and table refreshes.
Authentication is the HTTP front's: these routes are mounted behind its token check, which also
refuses a browser session's change sent from another site's page.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import jinja2
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.events import (
    AGENT_INFO,
    AGENT_LIST,
    AGENT_SEND_MESSAGE,
    COMPLETION_ASYNC,
    COMPLETION_CHUNK,
    COMPLETION_RESULT,
    CONSORTIUM_RUNS,
    CONSORTIUM_TRACE,
    CONVERSATION_ARCHIVE,
    CONVERSATION_EXPORT,
    CONVERSATION_FORK,
    CONVERSATION_LIST,
    CONVERSATION_PIN,
    CONVERSATION_SENT,
    CONVERSATION_SHOW,
    CONVERSATION_STATS,
    CONVERSATION_UNPIN,
    SYSTEM_HEALTH,
)
from ksi_common.ids import new_id
from ksi_common.settings import Settings
from ksi_common.submitting import follow
from ksi_daemon.context import EventContext
from ksi_daemon.transports.console import views
from ksi_daemon.transports.console.stream import READ_PREFIX, event_frames, sse, subscribe
from ksi_daemon.transports.http.door import (
    OriginCaller,
    RequestHandler,
    error_response,
    read_form,
    streamed_failure,
)
from ksi_daemon.transports.http.errors import status_for
from ksi_daemon.transports.http.front import RouteGroup

HERE = Path(__file__).parent
PAGE_SIZE = 50
TURNS_PER_PAGE = 50
STREAM_QUEUE = 2000  # frames a slow page may fall behind before the console drops and counts
ANSWER_TIMEOUT = 600.0
SSE_HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
# pages load only the console's own script, style and images: a model's reply that smuggles in
# a remote image or a form cannot make the browser send anything elsewhere, nor be framed
PAGE_POLICY = ("default-src 'self'; img-src 'self' data:; form-action 'self'; base-uri 'none'; "
               "frame-ancestors 'none'")


class Console:
    """The console's handlers, bound to the daemon's request function and settings."""

    def __init__(self, handle_request: RequestHandler, settings: Settings, root: str) -> None:
        self.handle_request = handle_request
        self.settings = settings
        self.root = root
        self.templates = jinja2.Environment(
            loader=jinja2.FileSystemLoader(HERE / "templates"),
            autoescape=True,  # conversation content is untrusted: `<script>` must render as text
        )
        self.templates.globals["root"] = root  # every link: the browser's cookie is sent only below it
        views.install_filters(self.templates)

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/", self.overview, name="console_overview"),
            Route("/events", self.events_page),
            Route("/events/stream", self.events_stream),
            Route("/agents", self.agents_page),
            Route("/agents/{agent_id}", self.agent_page),
            Route("/agents/{agent_id}/send", self.agent_send, methods=["POST"]),
            Route("/conversations", self.conversations_page),
            Route("/conversations/{conversation_id}", self.conversation_page),
            Route("/conversations/{conversation_id}/sent/{n:int}", self.sent_fragment),
            Route("/conversations/{conversation_id}/send", self.conversation_send, methods=["POST"]),
            Route("/conversations/{conversation_id}/fork", self.fork, methods=["POST"]),
            Route("/conversations/{conversation_id}/archive", self.archive, methods=["POST"]),
            Route("/conversations/{conversation_id}/pin", self.pin, methods=["POST"]),
            Route("/conversations/{conversation_id}/export", self.export),
            Route("/consortium", self.consortium_runs_page),
            Route("/consortium/{run_id}", self.consortium_page),
            Route("/health", self.health_page),
            Mount("/static", app=StaticFiles(directory=HERE / "static"), name="console_static"),
        ]

    # -- plumbing -------------------------------------------------------------
    async def read(self, event: str, data: dict[str, Any]) -> dict[str, Any]:
        """A request made to draw a page: the live view hides these unless asked (READ_PREFIX)."""
        return await self.handle_request(event, data, EventContext.root(correlation_id=new_id(READ_PREFIX)))

    async def act(self, event: str, data: dict[str, Any]) -> dict[str, Any]:
        """A request a person made through a page (fork, archive, send): shown like any other."""
        return await self.handle_request(event, data, EventContext.root(correlation_id=new_id("console-")))

    def render(self, template: str, code: int = 200, **values: Any) -> HTMLResponse:
        html = self.templates.get_template(template).render(**values)
        return HTMLResponse(html, status_code=code, headers={"Cache-Control": "no-store", "Content-Security-Policy": PAGE_POLICY})

    def failure(self, error: KsiError) -> HTMLResponse:
        return self.render("error.html", status_for(error.code), error=error, page="")

    # -- overview and health ----------------------------------------------------
    async def overview(self, request: Request) -> Response:
        health, agents, conversations = await asyncio.gather(
            self.read(SYSTEM_HEALTH, {}), self.read(AGENT_LIST, {"status": "active"}),
            self.read(CONVERSATION_LIST, {"limit": 10}))
        return self.render("overview.html", page="overview", health=health, agents=agents["agents"],
                           conversations=conversations)

    async def health_page(self, request: Request) -> Response:
        health = await self.read(SYSTEM_HEALTH, {})
        if request.query_params.get("fragment"):
            return self.render("health_body.html", health=health)
        return self.render("health.html", page="health", health=health)

    # -- events -------------------------------------------------------------------
    async def events_page(self, request: Request) -> Response:
        return self.render("events.html", page="events", query=dict(request.query_params))

    async def events_stream(self, request: Request) -> Response:
        patterns = [p for p in request.query_params.get("patterns", "*").split(",") if p] or ["*"]
        try:
            origin, _reply = await subscribe(self.handle_request, patterns, STREAM_QUEUE)
        except KsiError as error:
            return error_response(error)
        return StreamingResponse(event_frames(origin), media_type="text/event-stream", headers=SSE_HEADERS)

    # -- agents -------------------------------------------------------------------
    async def agents_page(self, request: Request) -> Response:
        status = request.query_params.get("status") or None
        agents = await self.read(AGENT_LIST, {"status": status} if status else {})
        infos = await asyncio.gather(*(self._agent_queue(a["agent_id"]) for a in agents["agents"]))
        template = "agents_table.html" if request.query_params.get("fragment") else "agents.html"
        return self.render(template, page="agents", agents=agents["agents"], queued=dict(infos), status=status)

    async def _agent_queue(self, agent_id: str) -> tuple[str, int]:
        try:
            info = await self.read(AGENT_INFO, {"agent_id": agent_id})
        except KsiError:
            return agent_id, 0  # terminated while the page was built
        return agent_id, int(info.get("queued_requests") or 0)

    async def agent_page(self, request: Request) -> Response:
        agent_id = request.path_params["agent_id"]
        try:
            info = await self.read(AGENT_INFO, {"agent_id": agent_id})
            shown = await self._turns(info["conversation_id"], request, missing_ok=True)
        except KsiError as error:
            return self.failure(error)
        return self.render("agent.html", page="agents", agent=info, **shown)

    async def agent_send(self, request: Request) -> Response:
        form = await read_form(request, self.settings.line_limit)
        data = {"agent_id": request.path_params["agent_id"], "message": str(form.get("prompt") or ""),
                "stream": True}
        return await self._answer(AGENT_SEND_MESSAGE, data)

    # -- conversations ------------------------------------------------------------
    async def conversations_page(self, request: Request) -> Response:
        query = request.query_params
        filters = {key: query[key].strip() for key in ("text", "status", "model", "tag", "agent_id")
                   if query.get(key, "").strip()}
        offset = _int(query.get("offset"), 0)
        try:
            listing = await self.read(CONVERSATION_LIST, {**filters, "limit": PAGE_SIZE, "offset": offset})
        except KsiError as error:
            return self.failure(error)
        pages = views.pages(listing["total"], offset, PAGE_SIZE)
        return self.render("conversations.html", page="conversations", listing=listing, filters=filters, pager=pages,
                           link=lambda o: f"{self.root}/conversations?" + urlencode({**filters, "offset": o}))

    async def _turns(self, conversation_id: str, request: Request, missing_ok: bool = False) -> dict[str, Any]:
        """A page of a conversation's exchanges (the newest by default) and its summary."""
        try:
            head = await self.read(CONVERSATION_SHOW, {"conversation_id": conversation_id, "limit": 1})
        except KsiError as error:
            if missing_ok and error.code == ErrorCode.CONVERSATION_NOT_FOUND:
                return {"conversation": None, "exchanges": [], "pager": None, "conversation_id": conversation_id}
            raise
        total = head["total_exchanges"]
        default = max(0, total - TURNS_PER_PAGE)
        offset = min(_int(request.query_params.get("offset"), default), max(total - 1, 0))
        shown = await self.read(CONVERSATION_SHOW, {"conversation_id": conversation_id, "offset": offset,
                                                     "limit": TURNS_PER_PAGE})
        return {"conversation": shown["conversation"], "exchanges": shown["exchanges"],
                "missing_parent": shown.get("missing_parent"), "conversation_id": conversation_id,
                "pager": views.pages(total, offset, TURNS_PER_PAGE)}

    async def conversation_page(self, request: Request) -> Response:
        conversation_id = request.path_params["conversation_id"]
        try:
            shown = await self._turns(conversation_id, request)
            stats = await self.read(CONVERSATION_STATS, {"conversation_id": conversation_id})
        except KsiError as error:
            return self.failure(error)
        return self.render("conversation.html", page="conversations", cache=stats.get("cache"), **shown)

    async def sent_fragment(self, request: Request) -> Response:
        data = {"conversation_id": request.path_params["conversation_id"], "n": request.path_params["n"]}
        try:
            sent = await self.read(CONVERSATION_SENT, data)
        except KsiError as error:
            return self.render("error_fragment.html", status_for(error.code), error=error)
        return self.render("sent.html", sent=sent)

    async def conversation_send(self, request: Request) -> Response:
        form = await read_form(request, self.settings.line_limit)
        data: dict[str, Any] = {"conversation_id": request.path_params["conversation_id"],
                                "prompt": str(form.get("prompt") or ""), "stream": True, "origin": "console"}
        if str(form.get("model") or "").strip():
            data["model"] = str(form["model"]).strip()
        return await self._answer(COMPLETION_ASYNC, data)

    async def fork(self, request: Request) -> Response:
        form = await read_form(request, self.settings.line_limit)
        data: dict[str, Any] = {"conversation_id": request.path_params["conversation_id"], "origin": "console"}
        if str(form.get("at") or "").strip():
            data["at"] = str(form["at"]).strip()  # the event validates it and names the field
        try:
            forked = await self.act(CONVERSATION_FORK, data)
        except KsiError as error:
            return self.failure(error)
        return RedirectResponse(f"{self.root}/conversations/{forked['conversation_id']}", status_code=303)

    async def archive(self, request: Request) -> Response:
        conversation_id = request.path_params["conversation_id"]
        try:
            await self.act(CONVERSATION_ARCHIVE, {"conversation_id": conversation_id})
        except KsiError as error:
            return self.failure(error)
        return RedirectResponse(f"{self.root}/conversations/{conversation_id}", status_code=303)

    async def pin(self, request: Request) -> Response:
        """The pin button of an exchange: `conversation:pin`, or `unpin` when the form says so."""
        conversation_id = request.path_params["conversation_id"]
        form = await read_form(request, self.settings.line_limit)
        event = CONVERSATION_UNPIN if form.get("unpin") else CONVERSATION_PIN
        try:
            await self.act(event, {"conversation_id": conversation_id, "n": str(form.get("n") or "").strip()})
        except KsiError as error:
            return self.failure(error)
        return RedirectResponse(f"{self.root}/conversations/{conversation_id}#turn-{form.get('n')}", status_code=303)

    async def export(self, request: Request) -> Response:
        conversation_id = request.path_params["conversation_id"]
        fmt = request.query_params.get("format", "markdown")
        try:
            exported = await self.read(CONVERSATION_EXPORT, {"conversation_id": conversation_id, "format": fmt})
        except KsiError as error:
            return self.failure(error)
        suffix, media = {"markdown": ("md", "text/markdown"), "json": ("json", "application/json"),
                         "jsonl": ("jsonl", "application/x-ndjson")}[fmt]
        return Response(exported["content"], media_type=f"{media}; charset=utf-8", headers={
            "Content-Disposition": f'attachment; filename="{conversation_id}.{suffix}"'})

    # -- consortium -----------------------------------------------------------------
    async def consortium_page(self, request: Request) -> Response:
        try:
            run = await self.read(CONSORTIUM_TRACE, {"run_id": request.path_params["run_id"]})
        except KsiError as error:
            return self.failure(error)
        return self.render("consortium.html", page="consortium", run=run)

    async def consortium_runs_page(self, request: Request) -> Response:
        offset = _int(request.query_params.get("offset"), 0)
        try:
            listing = await self.read(CONSORTIUM_RUNS, {"limit": PAGE_SIZE, "offset": offset})
        except KsiError as error:
            return self.failure(error)
        return self.render("consortium_runs.html", page="consortium", listing=listing,
                           pager=views.pages(listing["total"], offset, PAGE_SIZE))

    # -- a streamed answer ------------------------------------------------------------
    async def _answer(self, event: str, data: dict[str, Any]) -> Response:
        """Subscribe to chunks first, then queue the request: its chunks and outcome stream back as
        server-sent events, followed as every client follows one (ksi_common.submitting.follow);
        nothing is missed between the ack and the first chunk."""
        origin, _reply = await subscribe(self.handle_request, [COMPLETION_CHUNK], STREAM_QUEUE)
        try:
            ack = await self.act(event, data)
        except KsiError as error:
            origin.close()
            return Response(sse("error", error.to_wire()), status_code=status_for(error.code),
                            media_type="text/event-stream", headers=SSE_HEADERS)
        # its waits are the page's own reads: the live view hides them, as it hides the subscription
        caller = OriginCaller(self.handle_request, origin, READ_PREFIX)
        return StreamingResponse(_answer_frames(caller, ack), media_type="text/event-stream", headers=SSE_HEADERS)


async def _answer_frames(caller: OriginCaller, ack: dict[str, Any]) -> AsyncIterator[bytes]:
    """`queued`, a `chunk` per piece of text, then `result`, `error` or `cancelled`; nothing more when
    the answer takes longer than ANSWER_TIMEOUT (the page says it ended without one). A page that
    fell behind is told how many chunks it lost (`dropped`)."""
    request_id = str(ack.get("request_id"))
    reported = 0
    try:
        yield sse("queued", ack)
        async with contextlib.aclosing(follow(caller, request_id, ANSWER_TIMEOUT, once=True)) as followed:
            async for name, payload in followed:
                if name == COMPLETION_CHUNK and payload.get("text"):  # reasoning and calls come with the result
                    yield sse("chunk", {"index": payload.get("index"), "text": payload["text"]})
                elif name == COMPLETION_RESULT:
                    yield sse("result", payload)
                if caller.origin.lost != reported:
                    reported = caller.origin.lost
                    yield sse("dropped", {"dropped": reported})
    except KsiError as error:
        failure = streamed_failure(error, request_id)
        yield sse("cancelled" if error.code == ErrorCode.CANCELLED else "error",
                  {"request_id": request_id, "conversation_id": ack.get("conversation_id"),
                   "agent_id": ack.get("agent_id"), **failure.to_wire()})
    finally:
        caller.origin.close()


def _int(value: Any, default: int) -> int:
    try:
        return max(0, int(value))
    except (TypeError, ValueError):
        return default


def console_routes(handle_request: RequestHandler, settings: Settings, root: str) -> RouteGroup:
    """The console's routes, to mount at `/` (last) behind the HTTP front's token check; its pages
    link below `root`, where a browser session's cookie is sent."""
    return RouteGroup(Console(handle_request, settings, root).routes())
