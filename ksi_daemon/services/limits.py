"""The daemon's concurrency limits on provider calls: one object, shared by the completion
scheduler and the consortium, so a limit holds whoever makes the call.

Daemons sharing a database count a model's own limit, and the pool's limit when one is set, over
all of them (the storage's `CallSlots`); the daemon's `max_concurrency` is its own capacity. A call
takes its places here first (a semaphore each), so a daemon asks the database only for calls it
could make now."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager

from ksi_daemon.storage.ports import CallSlots, OneDaemonSlots

POOL_SCOPE = "*"  # the scope of the pool's own limit; a model's scope is its name


class ConcurrencyLimits:
    """At most `max_concurrency` calls at once, and at most a model's own limit per model."""

    def __init__(self, max_concurrency: int, model_limit: Callable[[str], int | None],
                 pool: CallSlots | None = None, pool_limit: int | None = None) -> None:
        self._global = asyncio.Semaphore(max_concurrency)
        self.capacity = max_concurrency
        self._model_limit = model_limit
        self._models: dict[str, asyncio.Semaphore] = {}
        self._pool: CallSlots = pool or OneDaemonSlots()
        self._pool_limit = pool_limit
        self.in_use = 0

    def _model_slot(self, model: str) -> asyncio.Semaphore | None:
        limit = self._model_limit(model)
        if not limit:
            return None
        slot = self._models.get(model)
        if slot is None:
            slot = self._models[model] = asyncio.Semaphore(limit)
        return slot

    def has_room(self, model: str) -> bool:
        """Whether a call of `model` would get this daemon's slots now, without waiting."""
        model_slot = self._model_slot(model)
        return not self._global.locked() and (model_slot is None or not model_slot.locked())

    def full_models(self) -> list[str]:
        """The models whose own slots here are all taken: a call of one would wait."""
        return [model for model, slot in self._models.items() if slot.locked()]

    @asynccontextmanager
    async def slot(self, model: str) -> AsyncIterator[None]:
        """Hold one call's slot for `model`."""
        # The model's slot first: a call waiting for its busy model must not hold a global
        # slot, or one saturated model would stall every other model.
        model_slot = self._model_slot(model)
        async with AsyncExitStack() as held:
            if model_slot is not None:
                await held.enter_async_context(model_slot)
                await held.enter_async_context(self._pool.hold(model, self._model_limit(model) or 0))
            await held.enter_async_context(self._global)
            if self._pool_limit is not None:
                await held.enter_async_context(self._pool.hold(POOL_SCOPE, self._pool_limit))
            self.in_use += 1
            try:
                yield
            finally:
                self.in_use -= 1
