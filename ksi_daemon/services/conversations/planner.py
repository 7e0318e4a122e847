"""What a turn sends of its conversation, within its `TurnBudget`: the exchanges shown, what stands in
for those left out (summaries, or the fallback), the pinned exchanges and the notes of the files.

The planner decides in the order of the budget's shares: the stand-in takes the summaries' share,
pins theirs, files theirs of what is left, exchanges the rest. Room a pin or a file takes from
the exchanges is given back when the history no longer references what needed it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, Self, TypeVar

from ksi_daemon.services.conversations.history import History, Pinned, fork_chain, pinned_exchanges, select_history
from ksi_daemon.services.conversations.memory import ConversationCache, ConversationMemory, Exchange
from ksi_daemon.services.conversations.stand_ins import StandIn
from ksi_daemon.services.conversations.turn_budget import TurnBudget


class StandIns(Protocol):
    """Where a turn's stand-in comes from (compaction's stored summaries and its fallback)."""

    async def for_turn(self, memory: ConversationMemory, model: str, budget: int,
                       share: int | None = None) -> StandIn | None: ...


class FileNotes(Protocol):
    """The files a turn embeds or notes, as one block before its new input."""

    @property
    def tokens(self) -> int: ...

    def kept_for(self, exchanges: Sequence[Exchange]) -> Self: ...


NotesT = TypeVar("NotesT", bound=FileNotes)
ReadT = TypeVar("ReadT", bound=FileNotes, covariant=True)


class FileReader(Protocol[ReadT]):
    """Reads the files a turn's history and new input reference, within a budget of tokens."""

    async def embed(self, exchanges: Sequence[Exchange], new_paths: Sequence[str], budget: int) -> ReadT: ...


@dataclass(slots=True)
class TurnPlan(Generic[NotesT]):
    """What a turn sends of its conversation: the history (pinned exchanges among it), the
    stand-in for exchanges 1..stand_in.upto, and the files' notes."""

    history: History
    files: NotesT
    stand_in: StandIn | None = None
    pinned: Pinned = field(default_factory=Pinned)
    root: str | None = None  # the root of the conversation's fork chain, whose prompt cache its turns meet

    @property
    def summary(self) -> str | None:
        return self.stand_in.text() if self.stand_in is not None else None


class TurnPlanner(Generic[NotesT]):
    """Plans each turn's history within its budget, across the conversation's fork chain."""

    def __init__(self, cache: ConversationCache, stand_ins: StandIns, files: FileReader[NotesT],
                 max_fork_depth: int, step: int) -> None:
        self.cache = cache
        self.stand_ins = stand_ins
        self.files = files
        self.max_fork_depth = max_fork_depth
        self.step = step  # exchanges the window's start moves by (history.stepped)

    async def plan(self, memory: ConversationMemory, budget: TurnBudget, new_paths: Sequence[str]
                   ) -> TurnPlan[NotesT]:
        """The exchanges, stand-in, pins and file notes of a turn of `budget.model`."""
        left = budget.history
        history = await self._select(memory, left)
        stand_in = await self._stand_in(memory, budget, history)
        after = stand_in.upto if stand_in is not None else 0
        if stand_in is not None:
            left -= stand_in.tokens
            history = await self._select(memory, left, after)
        history, pinned = await self._with_pins(memory, history, left, after, budget.pins, Pinned())
        left -= pinned.tokens
        files = await self.files.embed(history.exchanges, new_paths, budget.files(left))
        if files.tokens:  # files take their share first; history gets what they leave
            history = await self._select(memory, left - files.tokens, after)
            history, pinned = await self._with_pins(memory, history, left - files.tokens + pinned.tokens,
                                                    after, budget.pins, pinned)
            files = files.kept_for(history.exchanges)
        pinned.add_to(history, after)
        root = (await fork_chain(self.cache, memory, self.max_fork_depth))[-1][0].conversation_id
        return TurnPlan(history, files, stand_in, pinned, root)

    async def _select(self, memory: ConversationMemory, budget: int, after: int = 0) -> History:
        return await select_history(self.cache, memory, budget, self.max_fork_depth, after, self.step)

    async def _stand_in(self, memory: ConversationMemory, budget: TurnBudget, history: History
                        ) -> StandIn | None:
        """Summaries (or the fallback) standing in for the exchanges left out; None when none are,
        compaction is off (the note says what was left out) or the stand-in is too big to help."""
        if not history.omitted:
            return None
        stand_in = await self.stand_ins.for_turn(memory, budget.model, budget.history, budget.summaries)
        return stand_in if stand_in is not None and stand_in.tokens < budget.history else None

    async def _with_pins(self, memory: ConversationMemory, history: History, budget: int, after: int,
                         pins_budget: int, pinned: Pinned) -> tuple[History, Pinned]:
        """`history` (selected within `budget` less `pinned`'s tokens) and the pinned exchanges it
        leaves out, within `pins_budget`: a pin the history shows anyway costs nothing more. Room
        made for a pin may push out another, older one, pinned in turn (a few rounds at most)."""
        if not memory.meta.pins or not (history.omitted or after):
            return history, pinned
        for _ in range(len(memory.meta.pins)):
            taken = {e.n for e in history.entries} | {e.n for e in pinned.entries}
            more = await pinned_exchanges(self.cache, memory, pins_budget - pinned.tokens,
                                          self.max_fork_depth, taken)
            if not more.entries:
                break
            pinned.merge(more)
            history = await self._select(memory, budget - pinned.tokens, after)
        return history, pinned
