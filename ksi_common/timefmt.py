"""ISO-8601 UTC timestamps with a `Z`, the only time format on the wire and on disk."""

from __future__ import annotations

from datetime import UTC, datetime


def _iso(moment: datetime) -> str:
    # isoformat is C all the way (strftime with %f rebuilds its format on every call): an
    # exchange formats half a dozen times; timespec keeps the microseconds even when zero
    return moment.isoformat(timespec="microseconds")[:-6] + "Z"  # "+00:00" -> "Z"


def utc_now() -> str:
    """The current time as `2026-01-02T03:04:05.678901Z`."""
    return _iso(datetime.now(UTC))


def format_ts(moment: float) -> str:
    """A POSIX time as an ISO-8601 UTC string."""
    return _iso(datetime.fromtimestamp(moment, UTC))


def parse_ts(text: str) -> float:
    """An ISO-8601 string (with `Z` or an offset) as a POSIX time."""
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
