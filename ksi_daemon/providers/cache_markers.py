"""Anthropic prompt-cache breakpoints placed by KSI: the end of the system prompt (which also
closes the tools, sent ahead of it) and the end of the newest message, so the next turn, which
extends this one, reads everything up to it from the cache. A request whose messages already
carry a client's `cache_control` is sent as it came: the client placed its own."""

from __future__ import annotations

from typing import Any

EPHEMERAL = {"type": "ephemeral"}
MARKED_ROLES = ("system", "user", "assistant")  # litellm carries cache_control on these roles' blocks


def has_markers(messages: list[dict[str, Any]]) -> bool:
    """Whether any message (or block of one) carries a client's cache_control."""
    for message in messages:
        if "cache_control" in message:
            return True
        content = message.get("content")
        if isinstance(content, list) and any(isinstance(b, dict) and "cache_control" in b for b in content):
            return True
    return False


def _marked(message: dict[str, Any]) -> dict[str, Any]:
    """A copy of `message` whose last content block carries the breakpoint."""
    content = message.get("content")
    blocks: list[dict[str, Any]] = ([{"type": "text", "text": content}] if isinstance(content, str)
                                    else [dict(b) for b in content or []])
    if not blocks:
        return message
    blocks[-1]["cache_control"] = EPHEMERAL
    return {**message, "content": blocks}


def with_breakpoints(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with KSI's breakpoints (a new list; the caller's messages are not changed)."""
    if has_markers(messages):
        return messages
    placed = list(messages)
    targets = [i for i, m in enumerate(placed) if m.get("role") == "system"][-1:]
    last = next((i for i in range(len(placed) - 1, -1, -1) if placed[i].get("role") in MARKED_ROLES), None)
    if last is not None and last not in targets:
        targets.append(last)
    for index in targets:
        if isinstance(placed[index].get("content"), (str, list)):
            placed[index] = _marked(placed[index])
    return placed
