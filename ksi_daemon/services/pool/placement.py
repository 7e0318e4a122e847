"""Run here or hand over: where a turn holding its conversation's lease runs, asked by the
scheduler and answered here.

A turn that finds no free call slot here is offered to the pool (`PoolRequests.offer`) while it
waits; a daemon with a free slot may claim it. Whichever comes first, the slot here or the claim,
wins: the turn withdraws its offer before it runs, and one claimed is handed over. While offered,
the slot is waited for in a task of its own beside the turn's `word`, so a claim or a cancel heard
meanwhile wakes the wait without cancelling the conversation's worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from enum import StrEnum

from ksi_daemon.services.limits import ConcurrencyLimits
from ksi_daemon.services.pool.turn import PooledTurn, TurnState
from ksi_daemon.storage.ports import PoolRequests


class Place(StrEnum):
    HERE = "here"  # holding a slot here: run it
    HANDED_OVER = "handed_over"  # claimed by another daemon: it runs there
    CANCELLED = "cancelled"  # cancelled while offered, and its offer withdrawn


class HeldSlot:
    """A call slot waited for and held by a task of its own, until `release`."""

    def __init__(self, limits: ConcurrencyLimits, model: str, on_room: Callable[[], None]) -> None:
        self._limits = limits
        self._model = model
        self._on_room = on_room
        self._got: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._release = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._hold())

    async def _hold(self) -> None:
        async with self._limits.slot(self._model):
            self._got.set_result(None)
            await self._release.wait()
        self._on_room()

    async def or_word(self, word: asyncio.Event) -> bool:
        """Wait for the slot or the word, whichever comes first; True once the slot is held."""
        hearing = asyncio.get_running_loop().create_task(word.wait())
        try:
            await asyncio.wait({self._got, hearing, self._task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            hearing.cancel()
        if self._task.done() and not self._got.done():
            self._task.result()  # the slot's own failure, raised here
        return self._got.done()

    async def release(self) -> None:
        self._release.set()
        if not self._got.done():
            self._task.cancel()
        await asyncio.wait({self._task})


class Placement:
    def __init__(self, limits: ConcurrencyLimits, offers: PoolRequests) -> None:
        self._limits = limits
        self._offers = offers
        self._offered: dict[str, PooledTurn] = {}  # ticket -> a turn offered while it waits for a slot
        self.on_room: Callable[[], None] = lambda: None
        self.anyone_to_take: Callable[[], bool] = lambda: True  # another live daemon could claim an offer
        self.coming: set[str] = set()  # tickets of turns claimed for this daemon, not yet asking for a slot
        self.wanting = 0  # turns holding their lease, waiting for a slot here

    def claimed(self, ticket: str) -> None:
        """Word that another daemon claimed the turn offered under `ticket`."""
        turn = self._offered.get(ticket)
        if turn is not None:
            turn.claim()

    @asynccontextmanager
    async def place(self, turn: PooledTurn, ticket: str, model: str) -> AsyncIterator[Place]:
        """Run here or hand over? The slot is held for the block when the answer is here."""
        # a turn this daemon claimed is never offered again: it came here because there was room,
        # and a request passed back and forth would have two runs of it on one daemon at once
        offerable = ticket not in self.coming
        self.coming.discard(ticket)
        turn.wait_for_slot()
        async with AsyncExitStack() as stack:
            self.wanting += 1
            try:
                place = await self._take_room(turn, ticket, model, offerable, stack)
            finally:
                self.wanting -= 1
            yield place

    async def _take_room(self, turn: PooledTurn, ticket: str, model: str, offerable: bool,
                         stack: AsyncExitStack) -> Place:
        if offerable and not self._limits.has_room(model) and self.anyone_to_take():
            turn.offer()  # before asking: a cancel heard meanwhile withdraws it
            if await self._offers.offer(ticket):
                slot = HeldSlot(self._limits, model, self.on_room)
                stack.push_async_callback(slot.release)
                return await self._while_offered(turn, ticket, slot)
            if turn.state is TurnState.WITHDRAWN:
                return Place.CANCELLED
            turn.wait_for_slot()
        await stack.enter_async_context(self._limits.slot(model))
        stack.callback(self.on_room)
        return Place.HERE

    async def _while_offered(self, turn: PooledTurn, ticket: str, slot: HeldSlot) -> Place:
        standing = True  # an offer that must be withdrawn before the turn runs or is cancelled
        kept = True
        while turn.state is not TurnState.WITHDRAWN:
            self._offered[ticket] = turn
            try:
                if await slot.or_word(turn.word):
                    break
            finally:
                self._offered.pop(ticket, None)
            # told it was claimed, or cancelled: the database says whether it still is this
            # daemon's (the word of a claim may be late, about an earlier claim of a turn offered again since)
            kept = await self._offers.withdraw(ticket)
            standing = False
            if not kept or turn.state is TurnState.WITHDRAWN:
                break
            turn.offer()
            await self._offers.offer(ticket)
            standing = True
        if standing:
            kept = await self._offers.withdraw(ticket)
        if not kept:
            return Place.HANDED_OVER
        if turn.state is TurnState.WITHDRAWN:
            return Place.CANCELLED
        turn.wait_for_slot()
        return Place.HERE
