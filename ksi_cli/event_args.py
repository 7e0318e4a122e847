"""Turn `--key value` words after the event name into a JSON payload."""

from __future__ import annotations

import json
from typing import Any


class EventArgsError(ValueError):
    pass


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_event_args(words: list[str]) -> dict[str, Any]:
    """`--some-key 42 --flag --name bob` -> {"some_key": 42, "flag": True, "name": "bob"}."""
    data: dict[str, Any] = {}
    index = 0
    while index < len(words):
        word = words[index]
        if not word.startswith("--") or len(word) == 2:
            raise EventArgsError(f"expected --key before {word!r}")
        key, has_inline, inline = word[2:].partition("=")
        key = key.replace("-", "_")
        if has_inline:
            data[key] = _value(inline)
            index += 1
        elif index + 1 < len(words) and not words[index + 1].startswith("--"):
            data[key] = _value(words[index + 1])
            index += 2
        else:
            data[key] = True
            index += 1
    return data
