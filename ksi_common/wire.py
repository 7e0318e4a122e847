"""Newline-delimited JSON frames of the socket protocol."""

from __future__ import annotations

import time
from typing import Any

import orjson

from ksi_common.errors import KsiError

_second = -1
_second_text = ""


def utc_now() -> str:
    """`timefmt.utc_now()`'s format, about 4x cheaper: every reply frame carries one.

    The text of the whole second is formatted once per second; only microseconds change."""
    global _second, _second_text
    now = time.time()
    second = int(now)
    if second != _second:
        _second_text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        _second = second
    return f"{_second_text}.{int((now - second) * 1_000_000):06d}Z"


def encode(frame: dict[str, Any]) -> bytes:
    """One frame as a line of UTF-8 JSON, newline included."""
    return orjson.dumps(frame, default=str, option=orjson.OPT_APPEND_NEWLINE)


def decode(line: bytes) -> Any:
    return orjson.loads(line)


def success(event: str | None, correlation_id: str | None, data: Any) -> dict[str, Any]:
    return {"event": event, "correlation_id": correlation_id, "data": data, "timestamp": utc_now()}


def failure(event: str | None, correlation_id: str | None, error: KsiError) -> dict[str, Any]:
    return {
        "event": event,
        "correlation_id": correlation_id,
        "error": error.to_wire(),
        "timestamp": utc_now(),
    }
