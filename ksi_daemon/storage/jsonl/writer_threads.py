"""Threads of the conversation store's own for its synced writes (fsync on).

An exchange written with fsync on waits for an fsync, which must not block the event loop, so its
writes run on a thread, one hand-off there and back per exchange. `asyncio.to_thread` hands over
through concurrent.futures (a work item, two futures chained to each other, a condition variable)
and wakes whichever of its idle threads the lock picks, often one whose stack has left the CPU's
caches. Here a call goes to the thread that became idle last, and comes back by one
`call_soon_threadsafe`: in the daemon, 0.1 ms less CPU per exchange written one at a time
(scripts/bench/README.md). Under concurrent exchanges more threads start, up to `limit`, so their
fsyncs overlap as before.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(eq=False)
class _Call:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    context: contextvars.Context
    work: Callable[[], Any]
    result: Any = None
    error: BaseException | None = None

    def execute(self) -> None:
        try:
            self.result = self.context.run(self.work)
        except BaseException as exc:  # handed to the caller, whatever it is: a thread must not die
            self.error = exc

    def answer(self) -> None:
        try:
            self.loop.call_soon_threadsafe(_settle, self.future, self.result, self.error)
        except RuntimeError:  # the loop was closed meanwhile: nobody is left to answer
            pass


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # its caller was cancelled: the work ran to its end all the same
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


@dataclass(eq=False)
class _Worker:
    wake: threading.Lock = field(default_factory=threading.Lock)  # held while the thread sleeps
    call: _Call | None = None  # given with the wake-up; None there means stop


class WriterThreads:
    """Up to `limit` threads, started as calls need them, that run blocking calls for the loop."""

    def __init__(self, limit: int, name: str) -> None:
        self.limit = limit
        self.name = name
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []  # the one idle last is on top: it takes the next call
        self._queued: deque[_Call] = deque()  # calls that came while every thread was busy
        self._threads: list[threading.Thread] = []
        self._closing = False

    async def run(self, work: Callable[[], T]) -> T:
        """`work()` on a thread, in a copy of the caller's context (log fields bound to the
        request stay with it). A cancelled caller stops waiting; the work still finishes."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._submit(_Call(loop, future, contextvars.copy_context(), work))
        return await future

    def _submit(self, call: _Call) -> None:
        with self._lock:
            if self._idle:
                worker = self._idle.pop()
                worker.call = call
                worker.wake.release()
            elif len(self._threads) < self.limit:
                thread = threading.Thread(target=self._serve, args=(call,), daemon=True,
                                          name=f"{self.name}-{len(self._threads)}")
                self._threads.append(thread)
                thread.start()
            else:
                self._queued.append(call)

    def _serve(self, call: _Call | None) -> None:
        worker = _Worker()
        worker.wake.acquire()
        while call is not None:
            call.execute()
            with self._lock:  # idle before answering, so that the caller's next call comes here
                following = self._queued.popleft() if self._queued else None
                sleeps = following is None and not self._closing
                if sleeps:
                    self._idle.append(worker)
            call.answer()
            if sleeps:
                worker.wake.acquire()  # until _submit or close hands over
                following, worker.call = worker.call, None
            call = following

    def close(self) -> None:
        """Stop the threads once every call made so far has run (blocking)."""
        with self._lock:
            self._closing = True
            for worker in self._idle:
                worker.wake.release()  # with no call: the thread ends
            self._idle = []
            threads, self._threads = self._threads, []
        for thread in threads:
            thread.join()
        with self._lock:
            self._closing = False  # a call after close starts threads again
