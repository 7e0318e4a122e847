"""Per-conversation FIFO order, global and per-model concurrency, and nothing kept for idle
conversations: a conversation has a queue and a worker only while it has requests.

Daemons sharing a database keep one order per conversation between them: a job takes its place
in the conversation's line when it is submitted and runs while it holds the conversation's lease
(the storage's `ConversationLeases`), taken before a concurrency slot, so a job waiting for
another daemon's turn holds no slot."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import structlog

from ksi_daemon.services.limits import ConcurrencyLimits
from ksi_daemon.storage.ports import ConversationLeases, OneDaemonLeases

log = structlog.get_logger("ksi.scheduler")


@dataclass(eq=False)
class Job:
    key: str  # the conversation the job belongs to
    model: str
    run: Callable[[], Awaitable[Any]]
    on_cancel_queued: Callable[[], None]
    ticket: str  # its place in the conversation's line (the request id)
    on_taken_over: Callable[[], None] = lambda: None  # another daemon of the pool runs it now
    task: asyncio.Task[Any] | None = None  # the conversation's worker, while it runs this job
    cancelled: bool = False
    finished: bool = False
    meta: dict[str, Any] = field(default_factory=dict)


class Scheduler:
    def __init__(self, limits: ConcurrencyLimits, takes_slot: Callable[[str], bool] = lambda _model: True,
                 leases: ConversationLeases | None = None) -> None:
        self._limits = limits
        self._leases: ConversationLeases = leases or OneDaemonLeases()
        self._leaving: set[asyncio.Task[None]] = set()
        self._takes_slot = takes_slot  # False for jobs whose own calls take the slots (a consortium run)
        self._queues: dict[str, deque[Job]] = {}
        self._workers: dict[str, asyncio.Task[None]] = {}
        self.running = 0
        # jobs in the queues, kept as they come and go: admission reads it for every request, and
        # summing the queues cost a walk over every busy conversation each time
        self._queued = 0

    @property
    def queued(self) -> int:
        """Jobs waiting or running, over all conversations."""
        return self._queued

    @property
    def active_conversations(self) -> int:
        return len(self._queues)

    async def line_up(self, job: Job, record: dict[str, Any]) -> None:
        """Take `job`'s place in its conversation's line among every daemon's (before `submit`),
        with `record`, the request as accepted."""
        await self._leases.line_up(job.key, job.ticket, record)

    def submit(self, job: Job) -> int:
        """Queue `job` behind its conversation's earlier jobs; returns how many are ahead."""
        queue = self._queues.get(job.key)
        if queue is None:
            queue = self._queues[job.key] = deque()
            self._workers[job.key] = asyncio.get_running_loop().create_task(self._work(job.key, queue))
        queue.append(job)
        self._queued += 1
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
        """Cancel a queued job (removed at once) or a running one (its worker is cancelled, for this job only)."""
        if job.task is not None:
            if job.finished or job.cancelled:
                return False
            job.cancelled = True  # the worker takes this cancel as the job's, not its own
            job.task.cancel()
            return True
        queue = self._queues.get(job.key)
        if queue is None or job not in queue:
            return False
        queue.remove(job)
        self._queued -= 1
        job.cancelled = True
        job.on_cancel_queued()
        leaving = asyncio.get_running_loop().create_task(self._leases.leave_line(job.key, job.ticket))
        self._leaving.add(leaving)
        leaving.add_done_callback(self._leaving.discard)
        return True

    async def _work(self, key: str, queue: deque[Job]) -> None:
        """Run the conversation's jobs one after another in this task (no task per job: a
        cancelled job is this task cancelled once, taken back when the job has ended)."""
        worker = asyncio.current_task()
        assert worker is not None
        try:
            while queue:
                job = queue[0]
                async with self._leases.hold(job.key, job.ticket) as held, \
                        self._limits.slot(job.model) if held and self._takes_slot(job.model) else nullcontext():
                    if not held and not job.cancelled and queue and queue[0] is job:
                        queue.popleft()  # taken over while this daemon was paused: another daemon runs it
                        job.on_taken_over()
                    if not held or job.cancelled or not queue or queue[0] is not job:
                        continue
                    self.running += 1
                    job.task = worker
                    try:
                        await job.run()
                    except asyncio.CancelledError:
                        if not job.cancelled or worker.cancelling() > 1:
                            raise  # the worker itself is being cancelled (the scheduler stops)
                    except Exception:
                        log.exception("job_failed", conversation_id=key)
                    finally:
                        self.running -= 1
                        job.finished = True
                        if job.cancelled and worker.cancelling():
                            worker.uncancel()  # the job's cancel is spent; later awaits are the worker's own
                if queue and queue[0] is job:
                    queue.popleft()
                    self._queued -= 1
        finally:
            self._queued -= len(queue)  # jobs left when the worker is cancelled leave with their queue
            self._queues.pop(key, None)
            self._workers.pop(key, None)

    def jobs(self) -> list[Job]:
        return [job for queue in self._queues.values() for job in queue]

    async def stop(self, timeout: float) -> None:
        """Cancel queued jobs, give running ones `timeout` seconds, then cancel them."""
        for queue in self._queues.values():
            for job in list(queue)[1:]:
                self.cancel(job)
        running = [job.task for job in self.jobs() if job.task is not None and not job.finished]
        if running:  # only the running job is left in each queue: its worker ends with it
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
