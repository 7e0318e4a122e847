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
