"""The daemon's concurrency limits on provider calls: one object, shared by the completion
scheduler and the consortium, so a limit holds whoever makes the call."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager


class ConcurrencyLimits:
    """At most `max_concurrency` calls at once, and at most a model's own limit per model."""

    def __init__(self, max_concurrency: int, model_limit: Callable[[str], int | None]) -> None:
        self._global = asyncio.Semaphore(max_concurrency)
        self._model_limit = model_limit
        self._models: dict[str, asyncio.Semaphore] = {}
        self.in_use = 0

    def _model_slot(self, model: str) -> asyncio.Semaphore | None:
        limit = self._model_limit(model)
        if not limit:
            return None
        slot = self._models.get(model)
        if slot is None:
            slot = self._models[model] = asyncio.Semaphore(limit)
        return slot

    @asynccontextmanager
    async def slot(self, model: str) -> AsyncIterator[None]:
        """Hold one call's slot for `model`."""
        # The model's slot first: a call waiting for its busy model must not hold a global
        # slot, or one saturated model would stall every other model.
        model_slot = self._model_slot(model)
        if model_slot is not None:
            await model_slot.acquire()
        try:
            async with self._global:
                self.in_use += 1
                try:
                    yield
                finally:
                    self.in_use -= 1
        finally:
            if model_slot is not None:
                model_slot.release()
