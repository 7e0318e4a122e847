"""Work that must run to its end once begun, however often its task is cancelled meanwhile."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from ksi_daemon import eager

T = TypeVar("T")


async def to_the_end(work: Coroutine[Any, Any, T]) -> T:
    """Await `work` to its end; cancels arriving meanwhile are absorbed, its failure is raised.

    The work runs in a task of its own, started eagerly: work that needs no waiting (an unsynced
    file write) is done before this returns, with nothing to protect. `asyncio.shield` alone
    protects the work but not its waiting: a second cancel ends the wait while the work goes on
    unowned, so whoever waits on the caller (a task group, a shutdown) believes it finished. The
    caller re-raises a cancel it caught before, if it should count."""
    started = eager.start(work)
    if started.finished:
        return started.result
    running = started.task
    while not running.done():
        try:
            await asyncio.shield(running)
        except asyncio.CancelledError:
            continue
    return running.result()
