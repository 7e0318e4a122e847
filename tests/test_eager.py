"""Eager starts: the first step runs before `start` returns, inside the new task, and the rest of
the work carries on in that task (on 3.11 by KSI's own code, on 3.12+ by asyncio's eager_start)."""

from __future__ import annotations

import asyncio

import pytest

from ksi_daemon import eager


async def test_work_that_never_waits_is_finished_when_start_returns() -> None:
    seen: list[asyncio.Task[object] | None] = []

    async def quick() -> int:
        seen.append(asyncio.current_task())
        return 7

    caller = asyncio.current_task()
    started = eager.start(quick())
    assert started.finished and started.result == 7
    assert seen == [started.task]  # the first step ran inside the new task, not the caller
    assert asyncio.current_task() is caller  # the caller is current again
    await started.task  # and the task ends quietly when the loop reaches it


async def test_work_that_waits_goes_on_in_its_task() -> None:
    steps: list[str] = []

    async def slow() -> str:
        steps.append("first")
        await asyncio.sleep(0)
        steps.append("second")
        return "done"

    started = eager.start(slow())
    assert steps == ["first"] and not started.finished
    assert await started.task == "done"
    assert steps == ["first", "second"]


async def test_a_failing_first_step_is_raised_by_start() -> None:
    async def broken() -> None:
        raise ValueError("no")

    with pytest.raises(ValueError, match="no"):
        eager.start(broken())


async def test_a_timeout_inside_the_work_is_the_task_s_own() -> None:
    async def timed() -> bool:
        try:
            async with asyncio.timeout(0.01):
                await asyncio.sleep(5)
        except TimeoutError:
            return True
        return False

    started = eager.start(timed())
    assert await started.task is True
