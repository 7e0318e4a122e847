"""ISO-8601 UTC timestamps with a `Z`, the only time format on the wire and on disk."""

from __future__ import annotations

import time
from datetime import UTC, datetime

_second = -1
_second_text = ""


def _iso(moment: datetime) -> str:
    # isoformat is C all the way (strftime with %f rebuilds its format on every call): an
    # exchange formats half a dozen times; timespec keeps the microseconds even when zero
    return moment.isoformat(timespec="microseconds")[:-6] + "Z"  # "+00:00" -> "Z"


def utc_now() -> str:
    """The current time as `2026-01-02T03:04:05.678901Z`, about 4x cheaper than formatting a
    datetime: every reply frame and every record carries one. The whole second is formatted once
    per second; only the microseconds change."""
    global _second, _second_text
    now = time.time()
    second = int(now)
    if second != _second:
        _second_text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        _second = second
    return f"{_second_text}.{int((now - second) * 1_000_000):06d}Z"


def format_ts(moment: float) -> str:
    """A POSIX time as an ISO-8601 UTC string."""
    return _iso(datetime.fromtimestamp(moment, UTC))


def parse_ts(text: str) -> float:
    """An ISO-8601 string (with `Z` or an offset) as a POSIX time."""
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
