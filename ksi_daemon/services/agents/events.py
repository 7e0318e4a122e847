"""Events an agent writes into its reply: finding them, checking them, and telling it what happened."""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ksi_daemon.router import matches

MAX_EVENTS_PER_REPLY = 16
RESULT_PREVIEW = 300
FEEDBACK_HEADER = "[ksi] Outcome of the events in your last reply:"

_DECODER = json.JSONDecoder()
# After a `{` whose JSON does not parse: does it look like an attempted event? (No JSON is parsed here.)
_LOOKS_LIKE_EVENT = re.compile(r'\{\s*"event"\s*:')


@dataclass(slots=True)
class FoundEvent:
    event: str
    data: dict[str, Any]
    position: int


@dataclass(slots=True)
class Malformed:
    position: int
    reason: str


@dataclass(slots=True)
class Outcome:
    """What became of one event: ok with a result, an error code, denied, or not attempted."""

    event: str
    status: str  # ok | error | denied | skipped
    result: Any = None
    code: str | None = None
    message: str | None = None


def extract_events(text: str, limit: int = MAX_EVENTS_PER_REPLY) -> tuple[list[FoundEvent], list[Malformed]]:
    """Every `{"event": ..., "data": {...}}` object in `text`, inline or in fenced blocks, in order.

    An object counts as an event when its only keys are `event` and (optionally) `data`, so answers
    that merely show other JSON are left alone; an event-looking object that does not parse, or whose
    fields have the wrong types, is reported as malformed. Objects nested in a decoded one are not
    searched again.
    """
    found: list[FoundEvent] = []
    malformed: list[Malformed] = []
    position = text.find("{")
    while position >= 0:
        try:
            value, end = _DECODER.raw_decode(text, position)
        except json.JSONDecodeError as exc:
            if _LOOKS_LIKE_EVENT.match(text, position):
                malformed.append(Malformed(position, f"invalid JSON: {exc.msg} (char {exc.pos - position})"))
            position = text.find("{", position + 1)
            continue
        if isinstance(value, dict) and "event" in value and set(value) <= {"event", "data"}:
            event, data = value["event"], value.get("data", {})
            if not isinstance(event, str) or not event.strip():
                malformed.append(Malformed(position, "`event` must be a non-empty string"))
            elif not isinstance(data, dict):
                malformed.append(Malformed(position, f"`data` of {event} must be a JSON object"))
            elif len(found) >= limit:
                malformed.append(Malformed(position, f"{event}: more than {limit} events in one reply; ignored"))
            else:
                found.append(FoundEvent(event, data, position))
        position = text.find("{", end)
    return found, malformed


class ChainBudget:
    """How many events agents may still emit in each chain of events (a chain starts at a
    request from outside); the newest `chains` chains are remembered."""

    def __init__(self, limit: int, chains: int = 10_000) -> None:
        self.limit = limit
        self.chains = chains
        self._spent: OrderedDict[str, int] = OrderedDict()

    def take(self, chain_id: str | None) -> bool:
        """Spend one event of the chain's budget; False when none is left."""
        if chain_id is None:
            return True
        spent = self._spent.pop(chain_id, 0)
        self._spent[chain_id] = spent + (spent < self.limit)
        while len(self._spent) > self.chains:
            self._spent.popitem(last=False)
        return spent < self.limit


def is_allowed(event: str, patterns: Iterable[str]) -> bool:
    """Deny by default: allowed only when one of the profile's patterns matches."""
    return any(matches(pattern, event) for pattern in patterns)


def preview(value: Any, limit: int = RESULT_PREVIEW) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str, separators=(", ", ": "))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def feedback_text(outcomes: list[Outcome], malformed: list[Malformed]) -> str:
    """One message that tells the agent what each event it wrote did."""
    lines = [FEEDBACK_HEADER]
    for number, outcome in enumerate(outcomes, start=1):
        if outcome.status == "ok":
            detail = f"ok {preview(outcome.result)}"
        elif outcome.status == "denied":
            detail = "denied: your profile does not allow this event; it was not emitted"
        elif outcome.status == "skipped":
            detail = f"not emitted: {outcome.message}"
        else:
            detail = f"error {outcome.code}: {outcome.message}"
        lines.append(f"{number}. {outcome.event}: {detail}")
    for item in malformed:
        lines.append(f"- malformed event at char {item.position}, ignored: {item.reason}")
    return "\n".join(lines)
