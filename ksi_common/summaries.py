"""Conversation summaries: the record that stands in for exchanges left out of a long history."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ksi_common.jsonl import read_records


@dataclass(slots=True)
class Summary:
    """The summary of exchanges 1..upto of a conversation (its fork chain included)."""

    conversation_id: str
    upto: int
    text: str
    model: str | None = None
    tokens: int = 0  # the daemon's estimate of `text`, as history budgets count it
    previous_upto: int = 0  # the summary this one extended (0: written from scratch)
    usage: dict[str, int] = field(default_factory=dict)
    cost: float = 0.0
    ts: str | None = None

    def to_record(self) -> dict[str, Any]:
        return {"v": 1, "type": "summary", "conversation_id": self.conversation_id, "upto": self.upto,
                "previous_upto": self.previous_upto, "text": self.text, "model": self.model,
                "tokens": self.tokens, "usage": self.usage, "cost": self.cost, "ts": self.ts}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Summary | None:
        try:
            upto = int(record["upto"])
            text = str(record["text"])
            conversation_id = str(record["conversation_id"])
        except (KeyError, TypeError, ValueError):
            return None
        if upto < 1:
            return None
        usage = record.get("usage") if isinstance(record.get("usage"), dict) else {}
        return cls(conversation_id, upto, text, record.get("model"), int(record.get("tokens") or 0),
                   int(record.get("previous_upto") or 0), usage, float(record.get("cost") or 0.0),
                   record.get("ts"))


def read_summaries(path: Path) -> list[Summary]:
    """A conversation's summaries, oldest first; a torn or damaged line is skipped."""
    found = [Summary.from_record(r) for r in read_records(path)]
    return [s for s in found if s is not None]
