"""Turn `--key value` words after the event name into a JSON payload."""

from __future__ import annotations

import json
from typing import Any

from ksi_common.limits import out_of_range


class EventArgsError(ValueError):
    pass


def _refuse_constant(name: str) -> Any:
    raise EventArgsError(f"{name} is not a number JSON can carry")


def json_value(text: str) -> Any:
    """The word as JSON when it parses to a number, true/false/null, a list or an object, else the
    word itself (a quoted word keeps its quotes: `--prompt '"x"'` asks about "x", with them);
    numbers JSON cannot carry are refused."""
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except EventArgsError:
        raise
    except ValueError:
        return text
    if isinstance(value, str):
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


def event_words(words: list[str]) -> list[tuple[str, str | None]]:
    """`--some-key 42 --flag` -> [("some_key", "42"), ("flag", None)]: keys with their raw words."""
    pairs: list[tuple[str, str | None]] = []
    index = 0
    while index < len(words):
        word = words[index]
        if word == "-h":
            pairs.append(("h", None))
            index += 1
            continue
        if not word.startswith("--") or len(word) == 2:
            raise EventArgsError(f"expected --key before {word!r}")
        key, has_inline, inline = word[2:].partition("=")
        key = key.replace("-", "_")
        if has_inline:
            pairs.append((key, inline))
            index += 1
        elif index + 1 < len(words) and not words[index + 1].startswith("--"):
            pairs.append((key, words[index + 1]))
            index += 2
        else:
            pairs.append((key, None))
            index += 1
    return pairs
