"""Work that must run to its end once begun, however often its task is cancelled meanwhile."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def to_the_end(work: Awaitable[T]) -> T:
    """Await `work` to its end; cancels arriving meanwhile are absorbed, its failure is raised.

    `asyncio.shield` alone protects the work but not its waiting: a second cancel ends the wait
    while the work goes on unowned, so whoever waits on the caller (a task group, a shutdown)
    believes it finished. The caller re-raises a cancel it caught before, if it should count."""
    running = asyncio.ensure_future(work)
    while not running.done():
        try:
            await asyncio.shield(running)
        except asyncio.CancelledError:
            continue
    return running.result()
