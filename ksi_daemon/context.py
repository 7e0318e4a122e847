"""The context every event carries, so a chain of events can be traced to its cause."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

_PROCESS_PREFIX = f"evt-{os.urandom(4).hex()}-"
_SEQUENCE = itertools.count(1)


def _event_id() -> str:
    # unique across restarts by the random prefix, ordered within one daemon; a uuid4 per event
    # cost more than the rest of a health round trip's bookkeeping
    return f"{_PROCESS_PREFIX}{next(_SEQUENCE):x}"


class Origin(Protocol):
    """Where a request came from: a connection that can take pushes and tell when it closes."""

    def push(self, frame: dict[str, Any]) -> None: ...

    def on_close(self, callback: Callable[[], None]) -> Callable[[], None]: ...


class InternalOrigin:
    """The origin of events the daemon emits itself: pushes go nowhere, it never closes."""

    def push(self, frame: dict[str, Any]) -> None:
        return None

    def on_close(self, callback: Callable[[], None]) -> Callable[[], None]:
        return lambda: None


INTERNAL = InternalOrigin()


@dataclass(frozen=True, slots=True)
class EventContext:
    event_id: str
    correlation_id: str | None = None
    parent_event_id: str | None = None
    agent_id: str | None = None
    depth: int = 0  # how many agent-emitted hops led here; bounds feedback loops
    origin: Origin = field(default=INTERNAL, compare=False, repr=False)
    # the event id at the root of this chain: events agents emit are counted per chain
    chain_id: str | None = None

    @classmethod
    def root(
        cls,
        correlation_id: str | None = None,
        agent_id: str | None = None,
        origin: Origin = INTERNAL,
    ) -> EventContext:
        event_id = _event_id()
        return cls(event_id, correlation_id, None, agent_id, 0, origin, event_id)

    def child(self, **changes: Any) -> EventContext:
        """A context for an event caused by this one."""
        return replace(self, event_id=_event_id(), parent_event_id=self.event_id, **changes)

    def to_wire(self) -> dict[str, Any]:
        return {
            "event_id": self.event_id,
            "correlation_id": self.correlation_id,
            "parent_event_id": self.parent_event_id,
            "agent_id": self.agent_id,
        }
