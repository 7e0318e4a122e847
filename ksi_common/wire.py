"""Newline-delimited JSON frames of the socket protocol."""

from __future__ import annotations

from typing import Any

import orjson

from ksi_common.errors import KsiError
from ksi_common.timefmt import utc_now


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
