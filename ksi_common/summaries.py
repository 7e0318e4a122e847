"""Conversation summaries: the record that stands in for exchanges left out of a long history."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ksi_common.jsonl import read_records


@dataclass(slots=True)
class Summary:
    """What stands in for exchanges first..upto of a conversation (its fork chain included).

    `kind` "summary" is a summariser's text that passed its checks; "fallback" is written without
    a model (what the user said, and the salient items of the replies) where no candidate passed.
    `level` 0 summarises exchanges; a merge of several is one level above the highest it read.
    Records written before chunks existed extended one running summary: they cover 1..upto.
    """

    conversation_id: str
    upto: int
    text: str
    model: str | None = None
    tokens: int = 0  # the daemon's estimate of `text`, as history budgets count it
    previous_upto: int = 0  # a record written before chunks: the summary it extended
    usage: dict[str, int] = field(default_factory=dict)
    cost: float = 0.0
    ts: str | None = None
    first: int = 1
    kind: str = "summary"
    level: int = 0
    checks: dict[str, Any] = field(default_factory=dict)  # why it was used, or why the fallback stood in

    @property
    def fallback(self) -> bool:
        return self.kind == "fallback"

    def to_record(self) -> dict[str, Any]:
        return {"v": 1, "type": "summary", "conversation_id": self.conversation_id, "first": self.first,
                "upto": self.upto, "kind": self.kind, "level": self.level, "previous_upto": self.previous_upto,
                "text": self.text, "model": self.model, "tokens": self.tokens, "usage": self.usage,
                "cost": self.cost, "ts": self.ts, "checks": self.checks}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Summary | None:
        try:
            upto = int(record["upto"])
            text = str(record["text"])
            conversation_id = str(record["conversation_id"])
            first = int(record.get("first") or 1)
            level = int(record.get("level") or 0)
        except (KeyError, TypeError, ValueError):
            return None
        if upto < 1 or not 1 <= first <= upto:
            return None
        usage = record.get("usage") if isinstance(record.get("usage"), dict) else {}
        checks = record.get("checks") if isinstance(record.get("checks"), dict) else {}
        kind = "fallback" if record.get("kind") == "fallback" else "summary"
        if "first" not in record and int(record.get("previous_upto") or 0):
            level = 1  # a running summary rewritten from an earlier one
        return cls(conversation_id, upto, text, record.get("model"), int(record.get("tokens") or 0),
                   int(record.get("previous_upto") or 0), usage, float(record.get("cost") or 0.0),
                   record.get("ts"), first, kind, level, checks)


def read_summaries(path: Path) -> list[Summary]:
    """A conversation's summaries, oldest first; a torn or damaged line is skipped."""
    found = [Summary.from_record(r) for r in read_records(path)]
    return [s for s in found if s is not None]
