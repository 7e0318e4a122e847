"""Formatting for the console's templates: numbers, times, pagination."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import jinja2
import orjson

from ksi_common.timefmt import parse_ts


@dataclass(frozen=True, slots=True)
class Pager:
    total: int
    offset: int
    size: int

    @property
    def first(self) -> int:
        return self.offset + 1 if self.total else 0

    @property
    def last(self) -> int:
        return min(self.offset + self.size, self.total)

    @property
    def previous(self) -> int | None:
        return max(0, self.offset - self.size) if self.offset > 0 else None

    @property
    def next(self) -> int | None:
        return self.offset + self.size if self.offset + self.size < self.total else None


def pages(total: int, offset: int, size: int) -> Pager:
    return Pager(total, offset, size)


def ago(stamp: Any, now: float | None = None) -> str:
    """`3 min ago` from an ISO-8601 time; the raw text when it does not parse."""
    if not isinstance(stamp, str) or not stamp:
        return "never"
    try:
        seconds = (time.time() if now is None else now) - parse_ts(stamp)
    except ValueError:
        return stamp
    if seconds < 60:
        return f"{max(0, int(seconds))} s ago"
    if seconds < 3600:
        return f"{int(seconds // 60)} min ago"
    if seconds < 86400:
        return f"{int(seconds // 3600)} h ago"
    return f"{int(seconds // 86400)} d ago"


def money(value: Any) -> str:
    try:
        amount = float(value or 0.0)
    except (TypeError, ValueError):
        return "-"
    if not amount:
        return "-"
    return f"${amount:.4f}" if amount >= 0.0001 else f"${amount:.6f}"


def count(value: Any) -> str:
    try:
        return f"{int(value or 0):,}"
    except (TypeError, ValueError):
        return "-"


def pretty(value: Any) -> str:
    return orjson.dumps(value, option=orjson.OPT_INDENT_2, default=str).decode()


def install_filters(environment: jinja2.Environment) -> None:
    environment.filters.update(ago=ago, money=money, count=count, pretty=pretty)
