"""The event bus: request handlers by exact name, listeners by name or pattern."""

from __future__ import annotations

import difflib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog

from ksi_common.errors import ErrorCode, KsiError
from ksi_daemon.context import EventContext
from ksi_daemon.events import EventData, describe_fields, validate

log = structlog.get_logger("ksi.router")

Handler = Callable[[Any, EventContext], Awaitable[dict[str, Any]]]
Listener = Callable[[str, dict[str, Any], EventContext], None]
Unregister = Callable[[], None]
# No event name is longer; a longer unknown name is a client's mistake: it gets no close-match
# search (whose cost grows with the square of the name's length: 6 ms for 100 KB) and is cut
# in the error, which would otherwise send all of it back.
NAME_SHOWN = 100


@dataclass(frozen=True, slots=True)
class Route:
    name: str
    handler: Handler
    model: type[EventData]
    description: str


def did_you_mean(similar: list[str]) -> str:
    return f"; did you mean {' or '.join(similar)}?" if similar else ""


def matches(pattern: str, event: str) -> bool:
    """`*` matches all, `ns:*` every event of namespace `ns`, anything else itself."""
    if pattern == "*":
        return True
    if pattern.endswith(":*"):
        return event.startswith(pattern[:-1])
    return pattern == event


class Router:
    """Dispatches requests to their one handler and fans emitted events out to listeners."""

    def __init__(self) -> None:
        self._routes: dict[str, Route] = {}
        self._exact: dict[str, list[Listener]] = {}
        self._patterns: list[tuple[str, Listener]] = []
        self._emitted: dict[str, int] = {}  # names only ever emitted (no handler), by declarations

    # -- registration -------------------------------------------------------
    def register(
        self, name: str, handler: Handler, model: type[EventData], description: str
    ) -> Unregister:
        """Make `handler` answer requests for `name`; returns the function that undoes it."""
        if name in self._routes:
            raise ValueError(f"event {name} already has a handler")
        self._routes[name] = Route(name, handler, model, description)

        def unregister() -> None:
            self._routes.pop(name, None)

        return unregister

    def emits(self, *names: str) -> Unregister:
        """Declare events that are emitted but not requested (completion:result, ...), so a
        subscription to one is known and a misspelt one gets a suggestion; returns its undo."""
        for name in names:
            self._emitted[name] = self._emitted.get(name, 0) + 1

        def undeclare() -> None:
            for name in names:
                left = self._emitted.get(name, 0) - 1
                if left > 0:
                    self._emitted[name] = left
                else:
                    self._emitted.pop(name, None)

        return undeclare

    def listen(self, pattern: str, listener: Listener) -> Unregister:
        """Call `listener` for every emitted event matching `pattern`; returns its remover."""
        if pattern == "*" or pattern.endswith(":*"):
            entry = (pattern, listener)
            self._patterns.append(entry)
            return lambda: self._patterns.remove(entry) if entry in self._patterns else None
        bucket = self._exact.setdefault(pattern, [])
        bucket.append(listener)
        return lambda: bucket.remove(listener) if listener in bucket else None

    # -- dispatch -----------------------------------------------------------
    def route(self, name: str) -> Route:
        route = self._routes.get(name)
        if route is None:
            if len(name) > NAME_SHOWN:
                raise KsiError(ErrorCode.UNKNOWN_EVENT, f"unknown event {name[:NAME_SHOWN]!r}... "
                               f"({len(name)} characters)", similar=[])
            similar = difflib.get_close_matches(name, list(self._routes), n=5, cutoff=0.5)
            raise KsiError(ErrorCode.UNKNOWN_EVENT, f"unknown event {name!r}{did_you_mean(similar[:3])}",
                           similar=similar)
        return route

    def check_pattern(self, pattern: str) -> None:
        """Refuse a subscription pattern that no event can match (`unknown_event`, with the
        closest names): a misspelt name would otherwise wait silently for ever."""
        if pattern == "*":
            return
        if pattern.endswith(":*"):
            namespace = pattern[:-2]
            if namespace in self.namespaces():
                return
            similar = [f"{n}:*" for n in self.similar_namespaces(namespace)]
            raise KsiError(ErrorCode.UNKNOWN_EVENT, f"no event is in the namespace {pattern[:NAME_SHOWN]!r}"
                           f"{did_you_mean(similar)}", pattern=pattern[:NAME_SHOWN], similar=similar)
        if pattern in self._routes or pattern in self._emitted:
            return
        names = [*self._routes, *self._emitted]
        similar = difflib.get_close_matches(pattern, names, n=3, cutoff=0.5) if len(pattern) <= NAME_SHOWN else []
        raise KsiError(ErrorCode.UNKNOWN_EVENT, f"no event is named {pattern[:NAME_SHOWN]!r}{did_you_mean(similar)}",
                       pattern=pattern[:NAME_SHOWN], similar=similar)

    async def request(self, name: str, data: Any, context: EventContext) -> dict[str, Any]:
        """Validate `data` for `name`, tell listeners, run the handler and return its reply data."""
        route = self.route(name)
        payload = validate(route.model, data)
        if self._patterns or name in self._exact:
            self.emit(name, data, context)
        return await route.handler(payload, context)

    def emit(self, name: str, data: dict[str, Any], context: EventContext) -> None:
        """Deliver an event to every matching listener; one failing listener harms no other."""
        for listener in tuple(self._exact.get(name, ())):
            self._call(listener, name, data, context)
        for pattern, listener in list(self._patterns):
            if matches(pattern, name):
                self._call(listener, name, data, context)

    @staticmethod
    def _call(listener: Listener, name: str, data: dict[str, Any], context: EventContext) -> None:
        try:
            listener(name, data, context)
        except Exception:
            log.exception("listener_failed", event_name=name, listener=repr(listener))

    def namespaces(self) -> set[str]:
        return {name.split(":", 1)[0] for name in (*self._routes, *self._emitted)}

    def similar_namespaces(self, namespace: str) -> list[str]:
        """The namespaces closest to a misspelt one, best first."""
        if len(namespace) > NAME_SHOWN:
            return []
        return difflib.get_close_matches(namespace, sorted(self.namespaces()), n=3, cutoff=0.5)

    # -- self-description ---------------------------------------------------
    def events(self, namespace: str | None = None) -> list[Route]:
        routes = sorted(self._routes.values(), key=lambda r: r.name)
        if namespace:
            prefix = namespace.rstrip(":*") + ":"
            routes = [r for r in routes if r.name.startswith(prefix)]
        return routes

    def describe(self, name: str) -> dict[str, Any]:
        route = self.route(name)
        return {
            "event": route.name,
            "description": route.description,
            "fields": describe_fields(route.model),
        }
