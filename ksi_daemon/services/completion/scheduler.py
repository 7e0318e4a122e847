"""Per-conversation FIFO order, global and per-model concurrency, and nothing kept for idle
conversations: a conversation has a queue and a worker only while it has requests."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

log = structlog.get_logger("ksi.scheduler")


@dataclass(eq=False)
class Job:
    key: str  # the conversation the job belongs to
    model: str
    run: Callable[[], Awaitable[Any]]
    on_cancel_queued: Callable[[], None]
    task: asyncio.Task[Any] | None = None
    cancelled: bool = False
    meta: dict[str, Any] = field(default_factory=dict)


class Scheduler:
    def __init__(self, max_concurrency: int, model_limit: Callable[[str], int | None]) -> None:
        self._global = asyncio.Semaphore(max_concurrency)
        self._model_limit = model_limit
        self._model_slots: dict[str, asyncio.Semaphore] = {}
        self._queues: dict[str, deque[Job]] = {}
        self._workers: dict[str, asyncio.Task[None]] = {}
        self.running = 0

    @property
    def queued(self) -> int:
        """Jobs waiting or running, over all conversations."""
        return sum(len(q) for q in self._queues.values())

    @property
    def active_conversations(self) -> int:
        return len(self._queues)

    def submit(self, job: Job) -> int:
        """Queue `job` behind its conversation's earlier jobs; returns how many are ahead."""
        queue = self._queues.get(job.key)
        if queue is None:
            queue = self._queues[job.key] = deque()
            self._workers[job.key] = asyncio.get_running_loop().create_task(self._work(job.key, queue))
        queue.append(job)
        return len(queue) - 1

    def position(self, job: Job) -> int:
        queue = self._queues.get(job.key)
        if not queue:
            return 0
        try:
            return queue.index(job)
        except ValueError:
            return 0

    def cancel(self, job: Job) -> bool:
        """Cancel a queued job (removed at once) or a running one (its task is cancelled)."""
        if job.task is not None:
            if job.task.done():
                return False
            job.task.cancel()
            return True
        queue = self._queues.get(job.key)
        if queue is None or job not in queue:
            return False
        queue.remove(job)
        job.cancelled = True
        job.on_cancel_queued()
        return True

    def _slot(self, model: str) -> asyncio.Semaphore | None:
        limit = self._model_limit(model)
        if not limit:
            return None
        slot = self._model_slots.get(model)
        if slot is None:
            slot = self._model_slots[model] = asyncio.Semaphore(limit)
        return slot

    async def _work(self, key: str, queue: deque[Job]) -> None:
        try:
            while queue:
                job = queue[0]
                model_slot = self._slot(job.model)
                # The model's slot first: a job waiting for its busy model must not hold a global
                # slot, or one saturated model would stall every other model.
                if model_slot is not None:
                    await model_slot.acquire()
                try:
                    async with self._global:
                        if job.cancelled or not queue or queue[0] is not job:
                            continue
                        self.running += 1
                        job.task = asyncio.get_running_loop().create_task(job.run())
                        try:
                            await asyncio.shield(job.task)
                        except asyncio.CancelledError:
                            if not job.task.done():  # the worker itself is being cancelled
                                job.task.cancel()
                                raise
                        except Exception:
                            log.exception("job_failed", conversation_id=key)
                        finally:
                            self.running -= 1
                finally:
                    if model_slot is not None:
                        model_slot.release()
                if queue and queue[0] is job:
                    queue.popleft()
        finally:
            self._queues.pop(key, None)
            self._workers.pop(key, None)

    def jobs(self) -> list[Job]:
        return [job for queue in self._queues.values() for job in queue]

    async def stop(self, timeout: float) -> None:
        """Cancel queued jobs, give running ones `timeout` seconds, then cancel them."""
        for queue in self._queues.values():
            for job in list(queue)[1:]:
                self.cancel(job)
        running = [job.task for job in self.jobs() if job.task is not None and not job.task.done()]
        if running:
            _done, pending = await asyncio.wait(running, timeout=timeout)
            for task in pending:
                task.cancel()
        for queue in self._queues.values():
            for job in list(queue):
                if job.task is None:
                    self.cancel(job)
        workers = list(self._workers.values())
        for worker in workers:
            worker.cancel()
        if workers:
            await asyncio.wait(workers, timeout=1.0)
