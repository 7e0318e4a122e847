"""A client's own prompt-cache breakpoints (`cache_control` on a message), as a call sends them:
to Anthropic's API, the newest four (its limit per request; stored turns keep theirs, so a long
conversation holds more), each on its message's last block; to any other provider, none, since
the field is Anthropic's."""

from __future__ import annotations

from typing import Any

MAX_BREAKPOINTS = 4  # Anthropic refuses a request with more blocks marked


def sendable_markers(messages: list[dict[str, Any]], takes_markers: bool) -> list[dict[str, Any]]:
    """`messages` with the markers the provider may be sent (the same list when there are none)."""
    marked = [i for i, message in enumerate(messages) if "cache_control" in message]
    if not marked:
        return messages
    kept = set(marked[-MAX_BREAKPOINTS:] if takes_markers else [])
    out = list(messages)
    for index in marked:
        message = {key: value for key, value in messages[index].items() if key != "cache_control"}
        content = message.get("content")
        if index in kept and isinstance(content, list) and content:
            # litellm reads a message-level marker on text content only: a list's goes on its last part
            message["content"] = [*content[:-1], {**content[-1], "cache_control": messages[index]["cache_control"]}]
        elif index in kept:
            message["cache_control"] = messages[index]["cache_control"]
        out[index] = message
    return out
