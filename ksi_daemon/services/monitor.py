"""`monitor:*` events: push matching events to the connection that subscribed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog
from pydantic import Field, field_validator, model_validator

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.events import MONITOR_SUBSCRIBE, MONITOR_UNSUBSCRIBE
from ksi_common.ids import new_id
from ksi_common.timefmt import utc_now
from ksi_daemon.context import EventContext
from ksi_daemon.events import EventData, Text
from ksi_daemon.router import Router, Unregister, matches

log = structlog.get_logger("ksi.monitor")
Forward = Callable[[str, dict[str, Any], EventContext], None]


class SubscribeData(EventData):
    patterns: list[Text] = Field(default_factory=lambda: ["*"], description="`*`, `ns:*` or exact names")
    event_patterns: list[Text] | None = Field(default=None, description="older clients' name for patterns")
    client_id: Text | None = Field(default=None, description="older clients name themselves; echoed back")

    @model_validator(mode="before")
    @classmethod
    def _older_names(cls, data: Any) -> Any:
        # The original KSI client subscribes with {client_id, event_patterns}.
        if isinstance(data, dict) and data.get("event_patterns") is not None and "patterns" not in data:
            data = {**data, "patterns": data["event_patterns"]}
        return data

    @field_validator("patterns")
    @classmethod
    def _known_shapes(cls, patterns: list[str]) -> list[str]:
        for pattern in patterns:
            if not pattern or ("*" in pattern and pattern != "*" and not pattern.endswith(":*")):
                raise ValueError(f"pattern {pattern!r} must be `*`, `ns:*` or an exact event name")
        return patterns


class UnsubscribeData(EventData):
    subscription_id: Text = Field(description="the id monitor:subscribe returned")


class MonitorService:
    def __init__(self, router: Router) -> None:
        self.router = router
        self.subscriptions: dict[str, list[Unregister]] = {}
        # what other daemons' events need to reach this daemon's subscribers (not its services)
        self._remote: dict[str, tuple[list[str], Forward]] = {}

    def register(self) -> list[Unregister]:
        r = self.router
        return [
            r.register(MONITOR_SUBSCRIBE, self.subscribe, SubscribeData, "Push events matching patterns to this connection."),
            r.register(MONITOR_UNSUBSCRIBE, self.unsubscribe, UnsubscribeData, "End a subscription."),
        ]

    def count(self) -> int:
        return len(self.subscriptions)

    async def subscribe(self, data: SubscribeData, context: EventContext) -> dict[str, Any]:
        for pattern in data.patterns:
            self.router.check_pattern(pattern)
        subscription_id = new_id("sub-")
        origin = context.origin

        def forward(name: str, payload: dict[str, Any], event_context: EventContext) -> None:
            if name.startswith("monitor:"):
                return
            origin.push({
                "event": name,
                "data": payload,
                "push": True,
                "subscription_id": subscription_id,
                "event_id": event_context.event_id,
                "context": event_context.to_wire(),
                "timestamp": utc_now(),
            })

        removers = [self.router.listen(pattern, forward) for pattern in data.patterns]
        removers.append(origin.on_close(lambda: self._drop(subscription_id)))
        self.subscriptions[subscription_id] = removers
        self._remote[subscription_id] = (list(data.patterns), forward)
        reply: dict[str, Any] = {"subscription_id": subscription_id, "patterns": data.patterns, "status": "subscribed"}
        if data.client_id is not None or data.event_patterns is not None:  # what the original client reads
            reply.update(client_id=data.client_id, event_patterns=data.patterns, subscribed=True)
        return reply

    async def unsubscribe(self, data: UnsubscribeData, _context: EventContext) -> dict[str, Any]:
        if data.subscription_id not in self.subscriptions:
            raise KsiError(ErrorCode.VALIDATION_ERROR, "no such subscription",
                           fields={"subscription_id": "unknown"})
        self._drop(data.subscription_id)
        return {"subscription_id": data.subscription_id, "status": "unsubscribed"}

    def _drop(self, subscription_id: str) -> None:
        self._remote.pop(subscription_id, None)
        for remove in self.subscriptions.pop(subscription_id, []):
            remove()

    def deliver_remote(self, name: str, data: dict[str, Any], context: dict[str, Any]) -> None:
        """An event another daemon emitted: pushed to matching subscribers, never to services
        (they acted on it where it happened)."""
        event_context = EventContext(
            event_id=str(context.get("event_id") or ""), correlation_id=context.get("correlation_id"),
            parent_event_id=context.get("parent_event_id"), agent_id=context.get("agent_id"),
        )
        for patterns, forward in list(self._remote.values()):
            if any(matches(pattern, name) for pattern in patterns):
                try:
                    forward(name, data, event_context)
                except Exception:  # one broken subscriber harms no other
                    log.exception("remote_push_failed", event=name)
