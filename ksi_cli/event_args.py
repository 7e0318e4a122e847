"""Turn `--key value` words after the event name into a JSON payload."""

from __future__ import annotations

import json
from typing import Any

from ksi_common.limits import out_of_range


class EventArgsError(ValueError):
    pass


def _refuse_constant(name: str) -> Any:
    raise EventArgsError(f"{name} is not a number JSON can carry")


def _value(text: str) -> Any:
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except EventArgsError:
        raise
    except ValueError:
        return text
    problem = out_of_range(value)
    if problem is not None:
        raise EventArgsError(f"{text!r}: {problem}")
    return value


def check_payload(data: Any) -> None:
    """Refuse what has no JSON form (NaN, infinities, 1e400) instead of sending it as null."""
    problem = out_of_range(data)
    if problem is not None:
        raise EventArgsError(problem)


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
