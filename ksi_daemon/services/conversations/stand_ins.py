"""What stands in for a turn's left-out exchanges: stored summaries (or fallbacks) by range, a
fallback made for the turn, and a summary cut to its salient items to fit (salience.digest); how a
conversation's summaries are chosen to cover exchanges 1..n, and how each shows on the system message."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ksi_common.summaries import Summary


@dataclass(slots=True)
class Block:
    """One part of what stands in for left-out exchanges first..upto on the system message."""

    first: int
    upto: int
    kind: str  # "summary", "fallback" (stored, written without a model), "digest" (a stored one cut
    # to its salient items to fit), "recent" (this turn's fallback for exchanges no summary covers yet)
    text: str
    owner: str | None = None  # the conversation a stored summary belongs to

    def render(self) -> str:
        span = f"{self.first}-{self.upto}" if self.first != self.upto else f"{self.first}"
        head = {
            "summary": f"[Summary of exchanges {span} of this conversation, which are left out below:]",
            "fallback": f"[Exchanges {span}, left out below: the user's words and the items named]",
            "digest": f"[Exchanges {span}, left out below: the items named]",
            "recent": f"[Exchanges {span}, left out below (not summarised yet): the user's words and the items named]",
        }[self.kind]
        return f"{head}\n{self.text}"

    def to_record(self) -> dict[str, Any]:
        record: dict[str, Any] = {"first": self.first, "upto": self.upto, "kind": self.kind}
        if self.owner is not None and self.kind in ("summary", "fallback"):
            record["conversation_id"] = self.owner  # the text is read back from the stored summary
        else:
            record["text"] = self.text  # made for that turn: kept with its record
        return record


@dataclass(slots=True)
class StandIn:
    """What stands in for exchanges 1..upto in one turn, oldest first."""

    blocks: list[Block] = field(default_factory=list)
    tokens: int = 0

    @property
    def upto(self) -> int:
        return self.blocks[-1].upto if self.blocks else 0

    def text(self) -> str:
        return "\n\n".join(block.render() for block in self.blocks)

    def to_record(self) -> list[dict[str, Any]]:
        return [block.to_record() for block in self.blocks]

    def frozen_text(self) -> str:
        """The text of the blocks up to the newest stored one: it stays the same until a new summary
        is stored, while the turn's own fallback after it changes every turn."""
        stored = [i for i, block in enumerate(self.blocks) if block.kind in ("summary", "fallback")]
        return "\n\n".join(block.render() for block in self.blocks[:stored[-1] + 1]) if stored else ""


def stable_parts(system: str | None, stand_in: StandIn | None) -> list[str]:
    """What a turn's system message opens with that changes least: its system prompt, then the
    stored summaries standing in for the oldest exchanges."""
    return [part for part in (system, stand_in.frozen_text() if stand_in is not None else None) if part]


def summary_block(summary: Summary) -> Block:
    return Block(summary.first, summary.upto, "fallback" if summary.fallback else "summary", summary.text,
                 summary.conversation_id)


@dataclass(frozen=True, slots=True)
class TurnSaw:
    """The stored summaries a turn had to choose from: those its record names by range (a block of
    its stand-in), and every one stored before it was asked (`asked`, a timestamp)."""

    ranges: frozenset[tuple[int, int]]
    asked: str | None

    def includes(self, summary: Summary) -> bool:
        if (summary.first, summary.upto) in self.ranges:
            return True
        # one timestamp format throughout (ksi_common.timefmt): the strings order as the times do
        return self.asked is not None and summary.ts is not None and summary.ts <= self.asked


def cover(found: list[tuple[Summary, int | None]]) -> list[Summary]:
    """Consecutive summaries from exchange 1 on: at each start the one reaching furthest (a merge
    over its chunks), the newest on a tie. `found` pairs each summary with the last exchange its
    owner shares with the conversation (None: its own), so a fork never uses a parent's summary
    of turns after the fork."""
    by_first: dict[int, Summary] = {}
    for summary, limit in found:
        if limit is not None and summary.upto > limit:
            continue
        best = by_first.get(summary.first)
        if best is None or summary.upto >= best.upto:
            by_first[summary.first] = summary
    chosen: list[Summary] = []
    start = 1
    while start in by_first:
        chosen.append(by_first[start])
        start = chosen[-1].upto + 1
    return chosen
