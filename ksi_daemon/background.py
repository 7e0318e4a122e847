"""Background tasks a service or a store owns for as long as it runs (a heartbeat, a watcher, a
renewal): each round's failure logged and the next round tried, and stopped by cancelling them and
waiting until they have ended, so nothing they do outlives their owner's stop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from ksi_common.errors import KsiError


async def stop_task(task: asyncio.Task[Any] | None) -> None:
    """Cancel `task` (None: nothing to stop) and wait for it to end; its cancel is not raised here."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def one_round(work: Callable[[], Awaitable[None]], name: str, log: Any) -> None:
    """One round of a background loop: the database away (`{name}_failed`) or a fault of the round
    (`{name}_crashed`) is logged to its owner's `log`, never raised, so the loop's next round tries again."""
    try:
        await work()
    except KsiError as exc:
        log.warning(f"{name}_failed", error=exc.message)
    except Exception:
        log.exception(f"{name}_crashed")
