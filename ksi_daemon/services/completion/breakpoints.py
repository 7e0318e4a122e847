"""Where a turn's prompt-cache breakpoints went, by part of the request: the provider names the
indexes of the messages it sent, the turn's layout says what each index was (the system message,
a history exchange, the new input), so the record still reads right once the window has moved."""

from __future__ import annotations

from typing import Any

Part = tuple[str, int | None]  # "system", "history" or "input", and the exchange number of a history message


def layout(system: bool, history: list[tuple[int | None, int]], total: int) -> list[Part]:
    """The part of each of `total` messages: the system message (when there is one), each history
    exchange's `count` messages (`history` as (n, count) pairs), then the new input."""
    parts: list[Part] = [("system", None)] if system else []
    for n, count in history:
        parts.extend([("history", n)] * count)
    parts.extend([("input", None)] * max(0, total - len(parts)))
    return parts


def labelled(placed: list[dict[str, Any]], parts: list[Part], stable_kinds: list[str]) -> list[dict[str, Any]]:
    """The provider's breakpoints with the part each closes: in the system message, the system
    prompt or the summary when one closes that stable part (`stable_kinds`, in the call's order)."""
    out: list[dict[str, Any]] = []
    for point in placed:
        at = point.get("at")
        part, n = parts[at] if isinstance(at, int) and 0 <= at < len(parts) else ("input", None)
        closes = point.get("closes")
        if part == "system" and isinstance(closes, int) and 0 <= closes < len(stable_kinds):
            part = stable_kinds[closes]
        entry: dict[str, Any] = {"at": at, "part": part, "ttl": point.get("ttl"), "by": point.get("by")}
        if n is not None:
            entry["n"] = n
        out.append(entry)
    return out
