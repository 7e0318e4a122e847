"""The /mcp door's SSE events, kept in memory (a bounded number and size) so that a client whose
stream dropped can reconnect with `Last-Event-ID` and have the SDK's transport replay what it
missed.

The SDK hands one store to every session and names a stream by the client's request id, which
two sessions reuse ("1", "2", ...): each event is kept with the session that stored it, and a
replay sends only that session's events, and only to that session.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from contextvars import ContextVar
from dataclasses import dataclass
from itertools import count

from mcp.server.streamable_http import MCP_SESSION_ID_HEADER, EventCallback, EventMessage, EventStore
from mcp_types import JSONRPCMessage
from starlette.types import ASGIApp, Message, Receive, Scope, Send

MAX_EVENTS = 1000
MAX_BYTES = 16 * 1024 * 1024


class SessionOwner:
    """The session an HTTP request belongs to. A request that opens a session learns its id from
    its own response; the session's message loop, started from that request, shares the object."""

    def __init__(self, session_id: str | None) -> None:
        self.session_id = session_id


_owner: ContextVar[SessionOwner | None] = ContextVar("mcp_session_owner", default=None)


class SessionScoped:
    """ASGI wrapper around the MCP app: every request runs knowing its session's `SessionOwner`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = MCP_SESSION_ID_HEADER.lower().encode()
        given = next((value.decode("latin-1") for key, value in scope["headers"] if key.lower() == header), None)
        owner = SessionOwner(given)

        async def learn_session(message: Message) -> None:
            if message["type"] == "http.response.start" and owner.session_id is None:
                for key, value in message.get("headers", []):
                    if key.lower() == header:
                        owner.session_id = value.decode("latin-1")
            await send(message)

        token = _owner.set(owner)
        try:
            await self.app(scope, receive, send if given is not None else learn_session)
        finally:
            _owner.reset(token)


@dataclass(frozen=True, slots=True)
class _Event:
    owner: SessionOwner | None
    stream_id: str
    message: JSONRPCMessage | None  # None: a priming event, which the client only keeps the id of
    size: int


class SessionEventStore(EventStore):
    """The last `max_events` events (at most `max_bytes` of them), oldest forgotten first."""

    def __init__(self, max_events: int = MAX_EVENTS, max_bytes: int = MAX_BYTES) -> None:
        self.max_events = max_events
        self.max_bytes = max_bytes
        self._events: OrderedDict[str, _Event] = OrderedDict()
        self._bytes = 0
        self._prefix = secrets.token_hex(4)  # a restarted daemon's ids do not match an old client's
        self._ids = count(1)

    async def store_event(self, stream_id: str, message: JSONRPCMessage | None) -> str:
        event_id = f"{self._prefix}-{next(self._ids)}"
        size = 0 if message is None else len(message.model_dump_json(by_alias=True, exclude_unset=True))
        self._events[event_id] = _Event(_owner.get(), stream_id, message, size)
        self._bytes += size
        while len(self._events) > self.max_events or self._bytes > self.max_bytes:
            _id, oldest = self._events.popitem(last=False)
            self._bytes -= oldest.size
        return event_id

    async def replay_events_after(self, last_event_id: str, send_callback: EventCallback) -> str | None:
        last = self._events.get(last_event_id)
        if last is None or not _same_session(last.owner, _owner.get()):
            return None
        ids = list(self._events)
        missed = [(event_id, event) for event_id in ids[ids.index(last_event_id) + 1:]
                  if (event := self._events[event_id]).stream_id == last.stream_id
                  and event.message is not None and _same_session(event.owner, last.owner)]
        for event_id, event in missed:
            assert event.message is not None
            await send_callback(EventMessage(event.message, event_id))
        return last.stream_id


def _same_session(stored: SessionOwner | None, asking: SessionOwner | None) -> bool:
    return stored is not None and asking is not None and stored.session_id is not None \
        and stored.session_id == asking.session_id
