"""A turn as the pool sees it on the daemon that queued it: one state, and one method per move.

A move the state does not allow raises `IllegalMove`: two words about one turn (a claim and a
cancel, a late claim and a slot) are settled by the state, never by which flag was set last.
A claim or a cancel reaches a turn waiting for a slot as a message (`word`), which only the
wait for the slot listens to; the worker running its conversation is never cancelled for it.
"""

from __future__ import annotations

import asyncio
from enum import StrEnum


class TurnState(StrEnum):
    LINED = "lined"  # in its conversation's queue here, holding no slot
    WAITING = "waiting"  # holds its conversation's lease, waiting for a call slot here
    OFFERED = "offered"  # waiting for a slot, and offered to the pool meanwhile
    CLAIMED = "claimed"  # offered, and word came of a claim: withdrawing the offer says whose it is
    WITHDRAWN = "withdrawn"  # offered, and cancelled: cancelled once its offer is back, else handed over
    RUNNING = "running"
    ENDED = "ended"  # ran here, or cancelled
    HANDED_OVER = "handed_over"  # another daemon of the pool runs it


_MOVES: dict[TurnState, frozenset[TurnState]] = {
    # running at once: it needs no slot; ended: cancelled; handed over: taken over while this daemon was paused
    TurnState.LINED: frozenset({TurnState.WAITING, TurnState.RUNNING, TurnState.ENDED, TurnState.HANDED_OVER}),
    # lined again: another turn of its conversation was let ahead of it while it waited
    TurnState.WAITING: frozenset({TurnState.OFFERED, TurnState.RUNNING, TurnState.ENDED, TurnState.LINED}),
    # waiting again: the offer withdrawn and still this daemon's, its slot held
    TurnState.OFFERED: frozenset({TurnState.CLAIMED, TurnState.WITHDRAWN, TurnState.WAITING,
                                  TurnState.HANDED_OVER}),
    # offered again or waiting again: a late word about an earlier claim, the offer still this daemon's
    TurnState.CLAIMED: frozenset({TurnState.OFFERED, TurnState.WITHDRAWN, TurnState.WAITING,
                                  TurnState.HANDED_OVER}),
    TurnState.WITHDRAWN: frozenset({TurnState.ENDED, TurnState.HANDED_OVER}),
    # ended while running: its cancel is asked, the run unwinding
    TurnState.RUNNING: frozenset({TurnState.ENDED}),
    TurnState.ENDED: frozenset(),
    TurnState.HANDED_OVER: frozenset(),
}

_OFFERED = frozenset({TurnState.OFFERED, TurnState.CLAIMED, TurnState.WITHDRAWN})


class IllegalMove(RuntimeError):
    """A move the turn's state does not allow: a bug in whoever asked for it."""

    def __init__(self, state: TurnState, to: TurnState) -> None:
        super().__init__(f"a {state} turn cannot become {to}")
        self.state = state
        self.to = to


class PooledTurn:
    def __init__(self) -> None:
        self.state = TurnState.LINED
        self.word = asyncio.Event()  # a claim or a cancel heard while it waits offered

    def _move(self, to: TurnState) -> None:
        if to not in _MOVES[self.state]:
            raise IllegalMove(self.state, to)
        self.state = to

    @property
    def offered(self) -> bool:
        """An offer of it may stand: it runs or is cancelled only once the offer is withdrawn."""
        return self.state in _OFFERED

    @property
    def over(self) -> bool:
        return self.state in (TurnState.ENDED, TurnState.HANDED_OVER)

    def wait_for_slot(self) -> None:
        """Holding its lease, it asks for a slot here; or, offered, its offer came back and it holds one."""
        self._move(TurnState.WAITING)

    def back_in_line(self) -> None:
        self._move(TurnState.LINED)

    def offer(self) -> None:
        self._move(TurnState.OFFERED)
        self.word.clear()

    def claim(self) -> bool:
        """Word of a claim by another daemon; False when it changes nothing (not offered, or
        withdrawn already: the withdrawal's answer settles it either way)."""
        if self.state is not TurnState.OFFERED:
            return False
        self._move(TurnState.CLAIMED)
        self.word.set()
        return True

    def withdraw(self) -> None:
        """Cancelled while offered: cancelled once the offer is back, handed over if it was claimed."""
        self._move(TurnState.WITHDRAWN)
        self.word.set()

    def run(self) -> None:
        self._move(TurnState.RUNNING)

    def end(self) -> None:
        self._move(TurnState.ENDED)

    def hand_over(self) -> None:
        self._move(TurnState.HANDED_OVER)
