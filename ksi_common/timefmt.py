"""ISO-8601 UTC timestamps with a `Z`, the only time format on the wire and on disk."""

from __future__ import annotations

from datetime import UTC, datetime


def utc_now() -> str:
    """The current time as `2026-01-02T03:04:05.678901Z`."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def format_ts(moment: float) -> str:
    """A POSIX time as an ISO-8601 UTC string."""
    return datetime.fromtimestamp(moment, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_ts(text: str) -> float:
    """An ISO-8601 string (with `Z` or an offset) as a POSIX time."""
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
