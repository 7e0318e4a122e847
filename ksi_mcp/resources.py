"""The resources (`ksi://conversations` and `ksi://conversations/{id}`) and their change
notifications, for both eras of the protocol: `resources/subscribe` sessions and
`subscriptions/listen` streams."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from mcp.server.session import ServerSession
from mcp.server.subscriptions import InMemorySubscriptionBus, ResourcesListChanged, ResourceUpdated, ServerEvent

from ksi_common.events import CONVERSATION_CHANGED, CONVERSATION_EXPORT, CONVERSATION_LIST
from ksi_mcp.caller import CHANGE_EVENTS, Caller, StopWatching
from ksi_mcp.tools import conversation_uri

LIST_URI = "ksi://conversations"
TEMPLATE = "ksi://conversations/{id}"
LISTED = 200  # conversations in the list resource
RECENT = 20  # conversations named by resources/list


def conversation_id_of(uri: str) -> str | None:
    prefix = LIST_URI + "/"
    if uri.startswith(prefix) and len(uri) > len(prefix):
        return uri[len(prefix):]
    return None


async def read(caller: Caller, uri: str) -> tuple[str, str]:
    """(mime type, text) of a resource; an unknown conversation raises KSI's `conversation_not_found`."""
    if uri == LIST_URI:
        found = await caller.request(CONVERSATION_LIST, {"limit": LISTED})
        return "application/json", json.dumps(found, ensure_ascii=False, indent=1)
    conversation_id = conversation_id_of(uri)
    if conversation_id is None:
        raise LookupError(uri)
    export = await caller.request(CONVERSATION_EXPORT, {"conversation_id": conversation_id, "format": "markdown"})
    return "text/markdown", export["content"]


class WatchingBus(InMemorySubscriptionBus):
    """The listen streams' bus; the first listener starts the watch on KSI's events."""

    def __init__(self, on_listener: Callable[[], None]) -> None:
        super().__init__()
        self._on_listener = on_listener

    def subscribe(self, listener: Callable[[ServerEvent], None]) -> Callable[[], None]:
        self._on_listener()
        return super().subscribe(listener)


class ResourceWatch:
    """Turns KSI's change events into resource notifications for whoever subscribed."""

    def __init__(self, caller: Caller) -> None:
        self.caller = caller
        self.bus = WatchingBus(self._start)
        self.sessions: dict[str, set[ServerSession]] = {}  # uri -> legacy subscribers
        self._stop: StopWatching | None = None
        self._starting: asyncio.Task[None] | None = None
        self._sends: set[asyncio.Task[Any]] = set()

    def add(self, session: ServerSession, uri: str) -> None:
        self.sessions.setdefault(uri, set()).add(session)
        self._start()

    def remove(self, session: ServerSession, uri: str) -> None:
        self.sessions.get(uri, set()).discard(session)

    def _start(self) -> None:
        if self._starting is None:
            self._starting = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        self._stop = await self.caller.watch(CHANGE_EVENTS, self._on_event)

    async def close(self) -> None:
        if self._starting is not None:
            await asyncio.gather(self._starting, return_exceptions=True)
        if self._stop is not None:
            await self._stop()

    def _on_event(self, name: str, data: dict[str, Any]) -> None:
        conversation_id = data.get("conversation_id")
        uris = [LIST_URI] + ([conversation_uri(conversation_id)] if isinstance(conversation_id, str) else [])
        events: list[ServerEvent] = [ResourceUpdated(uri=uri) for uri in uris]
        if name == CONVERSATION_CHANGED and data.get("change") in ("created", "deleted"):
            events.append(ResourcesListChanged())
        self._send(self._publish(events))
        for uri in uris:
            for session in list(self.sessions.get(uri, ())):
                self._send(self._notify(session, uri))

    def _send(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    async def _publish(self, events: list[ServerEvent]) -> None:
        for event in events:
            await self.bus.publish(event)

    async def _notify(self, session: ServerSession, uri: str) -> None:
        try:
            await session.send_resource_updated(uri)
        except Exception:  # the session is gone: forget its subscriptions
            for subscribers in self.sessions.values():
                subscribers.discard(session)
