"""What the MCP tools need from KSI: send one event, and hear about conversation changes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from ksi_common.events import COMPLETION_RESULT, CONVERSATION_CHANGED

# (event name, event data): called on the event loop, must not block
EventListener = Callable[[str, dict[str, Any]], None]
StopWatching = Callable[[], Awaitable[None]]

# The events that change what the resources show: a new exchange, or a conversation created,
# updated, archived or deleted.
CHANGE_EVENTS = (COMPLETION_RESULT, CONVERSATION_CHANGED)


class Caller(Protocol):
    """A door into KSI: the daemon's socket (stdio server) or its router (HTTP server)."""

    async def request(self, event: str, data: dict[str, Any]) -> dict[str, Any]:
        """The reply data of `event`; a failure raises `KsiError` with KSI's code."""
        ...

    async def watch(self, events: tuple[str, ...], listener: EventListener) -> StopWatching:
        """Call `listener` for every emitted event named in `events` until the returned stop."""
        ...
