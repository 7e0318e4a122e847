"""A client's own prompt-cache breakpoints (`cache_control` on a message), as a call sends them:
to Anthropic's API, the newest four (its limit per request; stored turns keep theirs, so a long
conversation holds more); to any other provider, none, since the field is Anthropic's."""

from __future__ import annotations

from typing import Any

MAX_BREAKPOINTS = 4  # Anthropic refuses a request with more blocks marked


def sendable_markers(messages: list[dict[str, Any]], takes_markers: bool) -> list[dict[str, Any]]:
    """`messages` with the markers the provider may be sent (the same list when nothing changes)."""
    marked = [i for i, message in enumerate(messages) if "cache_control" in message]
    dropped = set(marked[:-MAX_BREAKPOINTS] if takes_markers else marked)
    if not dropped:
        return messages
    return [{key: value for key, value in message.items() if key != "cache_control"} if i in dropped else message
            for i, message in enumerate(messages)]
