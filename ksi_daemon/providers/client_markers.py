"""A client's own prompt-cache breakpoints (at a message's end), as a call sends them: Anthropic's
`cache_control` to Anthropic's API, the newest four (its limit per request; stored turns keep
theirs, so a long conversation holds more); OpenAI's `prompt_cache_breakpoint` to a model that
takes it, the newest three (OpenAI allows four cache writes a request and makes one itself). Each
goes on its message's last block; a provider that does not take a field is sent none of it."""

from __future__ import annotations

from typing import Any

from ksi_daemon.providers.cache_markers import OPENAI_MAX_BREAKPOINTS

MAX_BREAKPOINTS = 4  # Anthropic refuses a request with more blocks marked


def sendable_markers(messages: list[dict[str, Any]], takes_markers: bool,
                     takes_breakpoints: bool = False) -> list[dict[str, Any]]:
    """`messages` with the markers the provider may be sent (the same list when there are none):
    `takes_markers` for Anthropic's, `takes_breakpoints` for OpenAI's explicit ones."""
    out = _sendable(messages, "cache_control", MAX_BREAKPOINTS if takes_markers else 0)
    return _sendable(out, "prompt_cache_breakpoint", OPENAI_MAX_BREAKPOINTS if takes_breakpoints else 0)


def _sendable(messages: list[dict[str, Any]], key: str, most: int) -> list[dict[str, Any]]:
    """The newest `most` message-level markers `key` moved onto their messages' blocks; the rest left out."""
    marked = [i for i, message in enumerate(messages) if key in message]
    if not marked:
        return messages
    kept = set(marked[-most:] if most else [])
    out = list(messages)
    for index in marked:
        message = {name: value for name, value in messages[index].items() if name != key}
        content = message.get("content")
        if index in kept and isinstance(content, list) and content:
            # litellm reads a message-level marker on text content only: a list's goes on its last part
            message["content"] = [*content[:-1], {**content[-1], key: messages[index][key]}]
        elif index in kept and key == "cache_control":
            message[key] = messages[index][key]
        elif index in kept and isinstance(content, str):
            # OpenAI takes its breakpoint on a block only: the text becomes one
            message["content"] = [{"type": "text", "text": content, key: messages[index][key]}]
        out[index] = message
    return out
