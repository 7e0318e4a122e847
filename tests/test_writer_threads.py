"""WriterThreads: the threads the conversation store's synced writes run on (fsync on)."""

from __future__ import annotations

import asyncio
import contextvars
import threading

import pytest

from ksi_daemon.storage.jsonl.writer_threads import WriterThreads

REQUEST = contextvars.ContextVar("request", default="none")


def names(prefix: str) -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith(prefix)}


async def test_results_and_errors_come_back_to_the_caller() -> None:
    threads = WriterThreads(2, "wt-result")
    assert await threads.run(lambda: 6 * 7) == 42

    def fails() -> None:
        raise FileExistsError("taken")

    with pytest.raises(FileExistsError, match="taken"):
        await threads.run(fails)
    assert await threads.run(lambda: "still serving") == "still serving"
    threads.close()


async def test_the_work_sees_the_callers_context() -> None:
    threads = WriterThreads(1, "wt-context")
    REQUEST.set("req-7")
    assert await threads.run(REQUEST.get) == "req-7"
    threads.close()


async def test_calls_run_at_once_up_to_the_limit_and_the_rest_wait_for_a_free_thread() -> None:
    threads = WriterThreads(3, "wt-limit")
    barrier = threading.Barrier(3, timeout=5)  # broken unless three calls run at the same time
    running = threading.Semaphore(0)
    release = threading.Event()

    def meet() -> int:
        return barrier.wait()

    def hold() -> str:
        running.release()
        release.wait(5)
        return threading.current_thread().name

    assert sorted(await asyncio.gather(*(threads.run(meet) for _ in range(3)))) == [0, 1, 2]
    held = [asyncio.ensure_future(threads.run(hold)) for _ in range(4)]
    await asyncio.sleep(0)
    for _ in range(3):
        assert await asyncio.to_thread(running.acquire, True, 5)
    assert not await asyncio.to_thread(running.acquire, True, 0.2)  # the fourth waits: no fourth thread
    assert len(names("wt-limit")) == 3
    release.set()
    assert len(set(await asyncio.gather(*held))) == 3
    threads.close()


async def test_the_thread_idle_last_takes_the_next_call() -> None:
    """Calls one at a time stay on one thread, whose stack is still in the CPU's caches, however
    many threads an earlier burst started."""
    threads = WriterThreads(4, "wt-lifo")
    barrier = threading.Barrier(4, timeout=5)
    await asyncio.gather(*(threads.run(barrier.wait) for _ in range(4)))
    assert len(names("wt-lifo")) == 4
    ran_on = {await threads.run(lambda: threading.current_thread().name) for _ in range(30)}
    assert len(ran_on) == 1
    threads.close()


async def test_a_cancelled_caller_stops_waiting_and_the_work_still_finishes() -> None:
    threads = WriterThreads(1, "wt-cancel")
    started, release, done = threading.Event(), threading.Event(), threading.Event()

    def write() -> str:
        started.set()
        release.wait(5)
        done.set()
        return "written"

    waiter = asyncio.ensure_future(threads.run(write))
    assert await asyncio.to_thread(started.wait, 5)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert not done.is_set()
    release.set()
    assert await asyncio.to_thread(done.wait, 5)
    assert await threads.run(lambda: "next") == "next"  # the thread was not lost to the cancel
    threads.close()


async def test_close_runs_what_was_queued_then_ends_every_thread() -> None:
    threads = WriterThreads(2, "wt-close")
    release = threading.Event()
    finished: list[int] = []

    def write(i: int) -> None:
        release.wait(5)
        finished.append(i)

    calls = [asyncio.ensure_future(threads.run(lambda i=i: write(i))) for i in range(5)]
    await asyncio.sleep(0)
    closing = asyncio.ensure_future(asyncio.to_thread(threads.close))
    await asyncio.sleep(0.05)
    assert not closing.done()  # two calls hold both threads, three are queued
    release.set()
    await closing
    assert sorted(finished) == [0, 1, 2, 3, 4]
    assert names("wt-close") == set()
    await asyncio.gather(*calls)
    assert await threads.run(lambda: "again") == "again"  # a call after close starts a thread anew
    threads.close()
    assert names("wt-close") == set()


def test_a_call_whose_loop_closed_before_it_finished_does_not_stop_the_thread() -> None:
    threads = WriterThreads(1, "wt-closed-loop")
    started, release = threading.Event(), threading.Event()

    def slow() -> str:
        started.set()
        release.wait(5)
        return "late"

    loop = asyncio.new_event_loop()
    abandoned = loop.create_task(threads.run(slow))
    loop.run_until_complete(asyncio.sleep(0))
    assert started.wait(5)
    abandoned.cancel()
    loop.run_until_complete(asyncio.gather(abandoned, return_exceptions=True))
    loop.close()
    release.set()  # its answer now has no loop to go to
    assert asyncio.run(threads.run(lambda: "served")) == "served"
    threads.close()
