"""`to_the_end`: work begun is awaited to its end however often its waiter is cancelled."""

from __future__ import annotations

import asyncio

import pytest

from ksi_daemon.services.cancellation import to_the_end


async def test_a_waiter_cancelled_three_times_still_waits_for_the_work_and_gets_its_result() -> None:
    release = asyncio.Event()

    async def work() -> str:
        await release.wait()
        return "written"

    waiter = asyncio.create_task(to_the_end(work()))
    for _ in range(3):
        await asyncio.sleep(0.01)
        waiter.cancel()
    await asyncio.sleep(0.01)
    assert not waiter.done()
    release.set()
    assert await waiter == "written"


async def test_the_works_failure_is_raised_to_the_waiter() -> None:
    async def work() -> None:
        await asyncio.sleep(0.01)
        raise OSError("disk full")

    waiter = asyncio.create_task(to_the_end(work()))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(OSError, match="disk full"):
        await waiter


async def test_work_needing_no_wait_is_done_before_the_waiter_is_suspended() -> None:
    steps: list[str] = []

    async def work() -> str:
        steps.append("written")
        return "done"

    async def waiter() -> str:
        asyncio.get_running_loop().call_soon(steps.append, "the loop went on")
        result = await to_the_end(work())
        steps.append("returned")
        return result

    assert await asyncio.create_task(waiter()) == "done"
    await asyncio.sleep(0)
    # the waiter never gave the loop a turn: the callback queued before the work ran after it
    assert steps == ["written", "returned", "the loop went on"]


async def test_the_work_runs_as_its_own_task_and_the_caller_is_current_again_after() -> None:
    seen: list[asyncio.Task[object] | None] = []

    async def work() -> None:
        seen.append(asyncio.current_task())

    async def waiter() -> None:
        me = asyncio.current_task()
        await to_the_end(work())
        assert asyncio.current_task() is me
        seen.append(me)

    await asyncio.create_task(waiter())
    assert seen[0] is not None and seen[0] is not seen[1]


async def test_a_failure_in_the_first_step_is_raised_to_the_waiter() -> None:
    async def work() -> None:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        await to_the_end(work())
