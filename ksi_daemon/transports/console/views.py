"""Formatting for the console's templates: numbers, times, pagination, Markdown and usage."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jinja2
import orjson
from markdown_it import MarkdownIt
from markupsafe import Markup

from ksi_common.items import item_line, part_label
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


def usage_line(usage: Any) -> str:
    """`12 in · 30 out · 42 tokens`, with the cached and reasoning parts a provider reported."""
    if not isinstance(usage, dict) or not usage:
        return "usage not reported"
    tokens_in, tokens_out = usage.get("prompt_tokens"), usage.get("completion_tokens")
    parts = [f"{count(tokens_in)} in", f"{count(tokens_out)} out"]
    total = usage.get("total_tokens")
    if total is None and isinstance(tokens_in, int) and isinstance(tokens_out, int):
        total = tokens_in + tokens_out
    if total is not None:
        parts.append(f"{count(total)} tokens")
    cached = usage.get("cache_read_input_tokens") or (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached:
        rate = f" ({cached / tokens_in:.0%})" if isinstance(tokens_in, int) and tokens_in else ""
        parts.append(f"{count(cached)} cached{rate}")
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens")
    if reasoning:
        parts.append(f"{count(reasoning)} reasoning")
    return " · ".join(parts)


def origin_label(origin: Any) -> str:
    """The door that created a conversation, as the lists name it."""
    return {"cli": "CLI", "http": "HTTP", "mcp": "MCP", "llm": "llm", "agent": "agent",
            "console": "console"}.get(origin, "unknown") if origin else "unknown"


def markdown_renderer() -> Callable[[Any], Markup]:
    """Text (model replies, inputs) as Markdown, with raw HTML shown as text: a reply that holds
    `<script>` must never run; unsafe link schemes (javascript:) are refused by the parser."""
    # no images: an image in a reply would be fetched from wherever the model (or a prompt
    # injection) pointed it, with the conversation's text in its URL
    parser = (MarkdownIt("commonmark", {"html": False, "breaks": True})
              .enable(["table", "strikethrough"]).disable("image"))

    def render(text: Any) -> Markup:
        if not isinstance(text, str) or not text:
            return Markup("")
        return Markup(parser.render(text))  # safe as markup: with html off every tag in `text` was escaped

    return render


def install_filters(environment: jinja2.Environment) -> None:
    environment.filters.update(ago=ago, money=money, count=count, pretty=pretty, usage=usage_line,
                               origin=origin_label, markdown=markdown_renderer(), item_line=item_line,
                               part_label=part_label)
