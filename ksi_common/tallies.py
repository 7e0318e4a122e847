"""A conversation's running totals, brought up to date from its index.

The totals in a conversation's metadata (exchanges, tokens, cost, last activity, models) follow
from its index and response records. The JSONL store saves metadata that changed only in them
lazily, so after a kill its file can lag its index by the last exchanges; every reader (the
daemon loading a conversation, the inspection commands) counts those from the records here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ksi_common.ids import is_safe_id
from ksi_common.jsonl import iter_lines_reversed
from ksi_common.layout import VarLayout
from ksi_common.records import IndexEntry, parse_index_line, read_index, read_response

TALLIES = ("exchanges", "tokens_in", "tokens_out", "cost", "last_activity", "models")


def counted_through(meta: dict[str, Any]) -> int:
    """The number of the last exchange the metadata's totals count (a fork's own exchanges are
    numbered after those it shares)."""
    shared = int(meta.get("fork_at") or 0) if meta.get("parent_id") else 0
    return shared + int(meta.get("exchanges") or 0)


def entries_after(index: Path, n: int) -> list[IndexEntry]:
    """The index's entries numbered after `n`, oldest first, read from the end of the file."""
    found: list[IndexEntry] = []
    for line in iter_lines_reversed(index):
        entry = parse_index_line(line, 0)
        if entry is None:
            continue
        if entry.n == 0:  # a legacy line carries no number: count from the start
            return [e for e in read_index(index) if e.n > n]
        if entry.n <= n:
            break
        found.append(entry)
    found.reverse()
    return found


def _may_lag(layout: VarLayout, conversation_id: str, saved_at_ns: int) -> bool:
    """Whether the index changed since the metadata was saved (an equal time may hide either
    order: file times are coarse)."""
    try:
        return os.stat(layout.index_file(conversation_id)).st_mtime_ns >= saved_at_ns
    except FileNotFoundError:
        return False


def caught_up(layout: VarLayout, meta: dict[str, Any], saved_at_ns: int) -> dict[str, Any]:
    """`meta` (a metadata record saved at `saved_at_ns`) with the exchanges its totals miss
    counted in; `meta` itself when its index has not changed since."""
    conversation_id = str(meta.get("conversation_id") or "")
    if not is_safe_id(conversation_id) or not _may_lag(layout, conversation_id, saved_at_ns):
        return meta
    missing = entries_after(layout.index_file(conversation_id), counted_through(meta))
    if not missing:
        return meta
    meta = {**meta, "models": list(meta.get("models") or [])}
    for entry in missing:
        meta["exchanges"] = int(meta.get("exchanges") or 0) + 1
        if entry.ts:
            meta["last_activity"] = entry.ts
        if entry.model:
            if entry.model in meta["models"]:
                meta["models"].remove(entry.model)
            meta["models"].append(entry.model)  # the last one used is last
        record = read_response(layout.response_file(entry.response_id)) if is_safe_id(entry.response_id) else None
        outcome = record.outcome if record is not None and record.ok else None
        if outcome is None:
            continue
        usage = outcome.get("usage") if isinstance(outcome.get("usage"), dict) else {}
        meta["tokens_in"] = int(meta.get("tokens_in") or 0) + int(usage.get("prompt_tokens") or 0)
        meta["tokens_out"] = int(meta.get("tokens_out") or 0) + int(usage.get("completion_tokens") or 0)
        meta["cost"] = float(meta.get("cost") or 0.0) + float(outcome.get("cost") or 0.0)
    return meta
