"""Readers of the on-disk formats: conversation index lines and response files."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from ksi_common.items import INPUT_LINE_TYPES
from ksi_common.jsonl import iter_lines, iter_lines_reversed, read_records


@dataclass(slots=True)
class IndexEntry:
    """One exchange of a conversation, as its index line records it."""

    n: int
    response_id: str
    ts: str | None = None
    model: str | None = None
    provider: str | None = None
    agent_id: str | None = None
    tokens_in: int = 0
    tokens_out: int = 0
    is_feedback: bool = False
    run_id: str | None = None
    # the chained content digest (ksi_common.items.exchange_digest); None for an exchange stored
    # before digests existed, and for every later one of its conversation (the chain is broken)
    digest: str | None = None

    def to_record(self) -> dict[str, Any]:
        record: dict[str, Any] = {
            "v": 1,
            "n": self.n,
            "response_id": self.response_id,
            "ts": self.ts,
            "model": self.model,
            "provider": self.provider,
            "agent_id": self.agent_id,
            "tokens_in": self.tokens_in,
            "tokens_out": self.tokens_out,
        }
        if self.is_feedback:
            record["is_feedback"] = True
        if self.run_id:
            record["run_id"] = self.run_id
        if self.digest:
            record["digest"] = self.digest
        return record


def parse_index_line(line: bytes, position: int) -> IndexEntry | None:
    """An index line as an entry; a legacy bare response id gets its line position as `n`."""
    text = line.strip()
    if not text:
        return None
    if not text.startswith(b"{"):
        return IndexEntry(n=position, response_id=text.decode("utf-8", "replace"))
    try:
        record = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(record, dict) or "response_id" not in record:
        return None
    return IndexEntry(
        n=int(record.get("n") or position),
        response_id=str(record["response_id"]),
        ts=record.get("ts"),
        model=record.get("model"),
        provider=record.get("provider"),
        agent_id=record.get("agent_id"),
        tokens_in=int(record.get("tokens_in") or 0),
        tokens_out=int(record.get("tokens_out") or 0),
        is_feedback=bool(record.get("is_feedback")),
        run_id=record.get("run_id"),
        digest=record.get("digest") if isinstance(record.get("digest"), str) else None,
    )


def read_index(path: Path) -> list[IndexEntry]:
    """Every complete exchange line of an index, in order."""
    entries = []
    for position, line in enumerate(iter_lines(path), start=1):
        entry = parse_index_line(line, position)
        if entry is not None:
            entries.append(entry)
    return entries


class _Unnumbered(Exception):
    """A legacy index line without its number: numbering it needs the whole file."""


def read_index_tail(path: Path, token_budget: int) -> tuple[list[IndexEntry], int]:
    """The newest entries whose token counts fit `token_budget` (oldest first) and the total count.

    Reads the file from its end, so the cost follows the budget, not the conversation's length.
    Falls back to a forward read when it meets legacy lines that carry no number.
    """
    try:
        newest = _newest_first(path)
        head = next(newest, None)
        if head is None:
            return [], 0
        return _fit_tail(itertools.chain([head], newest), token_budget), head.n
    except _Unnumbered:
        entries = read_index(path)
        return _fit_tail(reversed(entries), token_budget), (entries[-1].n if entries else 0)


def _newest_first(path: Path) -> Iterator[IndexEntry]:
    for line in iter_lines_reversed(path):
        entry = parse_index_line(line, 0)
        if entry is None:
            continue
        if entry.n == 0:
            raise _Unnumbered
        yield entry


def _fit_tail(newest_first: Iterable[IndexEntry], token_budget: int) -> list[IndexEntry]:
    """The newest exchanges that fit the budget, oldest first; read no further than they reach."""
    picked: list[IndexEntry] = []
    spent = 0
    for entry in newest_first:
        if entry.is_feedback:
            continue
        cost = entry.tokens_in + entry.tokens_out
        if spent + cost > token_budget:
            break
        spent += cost
        picked.append(entry)
    picked.reverse()
    return picked


@dataclass(slots=True)
class ResponseRecord:
    """A response file: the request's raw inputs and its outcome."""

    response_id: str
    inputs: list[dict[str, Any]] = field(default_factory=list)
    outcome: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.outcome is not None and self.outcome.get("type") == "assistant"

    @property
    def content(self) -> str:
        return str(self.outcome.get("content") or "") if self.outcome else ""


INPUT_TYPES = INPUT_LINE_TYPES


def read_response(path: Path) -> ResponseRecord | None:
    """A response file, or None when it does not exist."""
    if not path.exists():
        return None
    record = ResponseRecord(response_id=path.stem)
    for line in read_records(path):
        kind = line.get("type")
        if kind in INPUT_TYPES:
            record.inputs.append(line)
        elif kind in ("assistant", "error"):
            record.outcome = line
    return record
