"""Tasks whose first step runs at once, inside the task: Python 3.12's eager tasks, and the same
behaviour built on 3.11 (where asyncio has no `eager_start`).

Work that often needs no waiting (a request answered from memory, an unsynced file write) is
then done in the same loop iteration: no scheduling round, no suspending of whoever started it.
The task exists before that first step and is the current task during it, so
`asyncio.current_task()`, `asyncio.timeout()` and TaskGroup behave as in any task; when the
work did wait, the task carries on from where the first step stopped.
"""

from __future__ import annotations

import asyncio
import collections.abc
import contextvars
import sys
from collections.abc import Coroutine
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class _FirstStepDone(collections.abc.Coroutine):  # type: ignore[type-arg]
    """A coroutine whose first step was run already; the task that carries it goes on from there."""

    __slots__ = ("_coro", "_state", "_yielded", "_result")
    _NEW, _SUSPENDED, _FINISHED, _RUNNING = range(4)

    def __init__(self, coro: Coroutine[Any, Any, Any]) -> None:
        self._coro = coro
        self._state = self._NEW
        self._yielded: Any = None
        self._result: Any = None

    def first_step(self) -> None:
        try:
            self._yielded = self._coro.send(None)
        except StopIteration as stop:
            self._result = stop.value
            self._state = self._FINISHED
        except BaseException:
            self._state = self._FINISHED
            raise
        else:
            self._state = self._SUSPENDED

    def send(self, value: Any) -> Any:
        state, self._state = self._state, self._RUNNING
        if state == self._SUSPENDED:
            return self._yielded  # the task now waits for what the first step waited for
        if state == self._FINISHED:
            raise StopIteration(self._result)
        return self._coro.send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        state, self._state = self._state, self._RUNNING
        if state == self._FINISHED:
            raise StopIteration(self._result)
        if val is None and tb is None:
            return self._coro.throw(typ)
        return self._coro.throw(typ, val, tb)

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Any:
        return self._coro.__await__()


class Started(Generic[T]):
    """A task started eagerly: `finished` when its first step ended it, with that `result`."""

    __slots__ = ("task", "_first")

    def __init__(self, task: asyncio.Task[T], first: _FirstStepDone | None = None) -> None:
        self.task = task
        self._first = first  # 3.11 only: the task itself is not done until the loop reaches it

    @property
    def finished(self) -> bool:
        if self._first is None:
            return self.task.done()
        return self._first._state == _FirstStepDone._FINISHED

    @property
    def result(self) -> T:
        if self._first is None:
            return self.task.result()
        return self._first._result  # type: ignore[no-any-return]


def start(coro: Coroutine[Any, Any, T]) -> Started[T]:
    """Run `coro` in a new task whose first step runs now, from a loop callback or from inside
    another task (which is current again afterwards). A failure of the first step is raised
    here; a step that finished leaves a task that is done (3.12+) or ends quietly when the loop
    reaches it (3.11)."""
    if sys.version_info >= (3, 12):
        task = asyncio.Task(coro, loop=asyncio.get_running_loop(), eager_start=True)
        if task.done() and not task.cancelled() and (failure := task.exception()) is not None:
            raise failure
        return Started(task)
    return _start_on_311(coro)


def _start_on_311(coro: Coroutine[Any, Any, T]) -> Started[T]:
    """What 3.12's `eager_start` does, with the task-switch hooks 3.11's eager-less asyncio has."""
    from asyncio.tasks import _enter_task, _leave_task  # private, and needed on 3.11 only

    loop = asyncio.get_running_loop()
    first = _FirstStepDone(coro)
    context = contextvars.copy_context()
    task: asyncio.Task[T] = loop.create_task(first, context=context)  # type: ignore[arg-type]
    caller = asyncio.current_task(loop)
    if caller is not None:
        _leave_task(loop, caller)
    _enter_task(loop, task)
    try:
        context.run(first.first_step)
    finally:
        _leave_task(loop, task)
        if caller is not None:
            _enter_task(loop, caller)
    return Started(task, first)
