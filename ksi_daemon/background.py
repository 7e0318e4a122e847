"""Background tasks a service or a store owns for as long as it runs (a heartbeat, a watcher, a
renewal): stopped by cancelling them and waiting until they have ended, so nothing they do
outlives their owner's stop."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


async def stop_task(task: asyncio.Task[Any] | None) -> None:
    """Cancel `task` (None: nothing to stop) and wait for it to end; its cancel is not raised here."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
