"""Per-conversation FIFO order, global and per-model concurrency, and nothing kept for idle
conversations: a conversation has a queue and a worker only while it has requests.

Daemons sharing a database keep one order per conversation between them: a job takes its place
in the conversation's line when it is submitted and runs while it holds the conversation's lease
(the storage's `ConversationLeases`), taken before a concurrency slot, so a job waiting for
another daemon's turn holds no slot. A conversation's queue here is in the order of those places:
a job taken over or claimed from another daemon keeps its place, ahead of later ones.

Work stealing: a job holding its lease that finds no free slot here is offered to the pool
(`PoolRequests.offer`) while it waits; a daemon with a free slot may claim it. Whichever comes
first, the slot here or the claim, wins: the job takes its offer back before it runs, and one
claimed leaves this daemon's queue as a job taken over does."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import structlog

from ksi_daemon.services.limits import ConcurrencyLimits
from ksi_daemon.storage.ports import ConversationLeases, OneDaemonLeases, OneDaemonRequests, PoolRequests

log = structlog.get_logger("ksi.scheduler")


@dataclass(eq=False)
class Job:
    key: str  # the conversation the job belongs to
    model: str
    run: Callable[[], Awaitable[Any]]
    on_cancel_queued: Callable[[], None]
    ticket: str  # names its place in the conversation's line (the request id)
    place: int = 0  # its place in the line: the conversation's jobs run in this order
    on_taken_over: Callable[[], None] = lambda: None  # another daemon of the pool runs it now
    task: asyncio.Task[Any] | None = None  # the conversation's worker, while it runs this job
    cancelled: bool = False
    finished: bool = False
    claimed: bool = False  # offered while it waited for a slot, and claimed by another daemon
    offered: bool = False  # an offer of it to the pool may stand: a cancel takes it back first
    withdrawing: bool = False  # cancelled while offered: cancelled once its offer is taken back, else handed over
    meta: dict[str, Any] = field(default_factory=dict)


class Scheduler:
    def __init__(self, limits: ConcurrencyLimits, takes_slot: Callable[[str], bool] = lambda _model: True,
                 leases: ConversationLeases | None = None, offers: PoolRequests | None = None) -> None:
        self._limits = limits
        self._leases: ConversationLeases = leases or OneDaemonLeases()
        self._offers: PoolRequests = offers or OneDaemonRequests()
        self._offered: dict[str, Job] = {}  # ticket -> a job offered to the pool while it waits for a slot
        self._on_room: Callable[[], None] = lambda: None
        self._anyone_to_take: Callable[[], bool] = lambda: True  # another live daemon could claim an offer
        self._coming: set[str] = set()  # tickets of jobs claimed for this daemon, not yet asking for a slot
        self._wanting = 0  # jobs holding their lease, waiting for a slot here
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

    async def in_line(self, key: str) -> int:
        """Turns of conversation `key` accepted and not ended over every daemon of the pool (0 on
        a backend no other daemon shares: `RequestRegistry.count_live` counts this daemon's)."""
        return await self._leases.in_line(key)

    def exclusive(self, key: str) -> AbstractAsyncContextManager[None]:
        """Held by one daemon of the pool at a time for `key` (see ConversationLeases.exclusive)."""
        return self._leases.exclusive(key)

    async def line_up(self, job: Job, record: dict[str, Any]) -> None:
        """Take `job`'s place in its conversation's line among every daemon's (before `submit`),
        with `record`, the request as accepted."""
        job.place = await self._leases.line_up(job.key, job.ticket, record)

    def submit(self, job: Job) -> int:
        """Queue `job` behind its conversation's jobs with earlier places; returns how many are ahead."""
        queue = self._queues.get(job.key)
        if queue is None:
            queue = self._queues[job.key] = deque()
            self._workers[job.key] = asyncio.get_running_loop().create_task(self._work(job.key, queue))
        self._queued += 1
        if not queue or queue[-1].place <= job.place:
            queue.append(job)
            return len(queue) - 1
        # taken over or claimed: ahead of the later ones, though never ahead of one already running
        at = next((i for i, other in enumerate(queue) if other.place > job.place and (i or other.task is None)),
                  len(queue))
        if at == 0:  # the first one was waiting for the lease: it lets this one go first
            self._leases.let_ahead(job.key, queue[0].ticket)
        queue.insert(at, job)
        return at

    def room(self) -> int:
        """Calls this daemon could start now beyond those it makes, the jobs waiting for a slot here
        and the jobs it claimed that will (a job waiting for another daemon's turn wants none yet)."""
        return self._limits.capacity - self._limits.in_use - self._wanting - len(self._coming)

    async def leave_line(self, key: str, ticket: str) -> None:
        """Give up a place taken in a conversation's line by a job that was never submitted."""
        await self._leases.leave_line(key, ticket)

    def full_models(self) -> list[str]:
        """Models a job claimed now would wait for: their own slots here are all taken."""
        return self._limits.full_models()

    def expect(self, ticket: str) -> None:
        """A job claimed from another daemon is on its way here: counted as wanting a slot already."""
        self._coming.add(ticket)

    def unexpect(self, ticket: str) -> None:
        self._coming.discard(ticket)

    def when_room(self, call: Callable[[], None]) -> None:
        """Call `call` whenever a job here gives its slot back."""
        self._on_room = call

    def offer_when(self, anyone_to_take: Callable[[], bool]) -> None:
        """Offer waiting jobs only while `anyone_to_take()`: alone, an offer costs two round trips for nothing."""
        self._anyone_to_take = anyone_to_take

    def claimed(self, ticket: str) -> None:
        """Another daemon claimed the job offered under `ticket`: it stops waiting for a slot here."""
        job = self._offered.get(ticket)
        worker = self._workers.get(job.key) if job is not None else None
        if job is not None and worker is not None and not job.claimed:
            if not job.withdrawing:  # else woken already; one cancel of the worker wakes it for both
                worker.cancel()  # taken back in `_room`, as this job's own
            job.claimed = True

    def position(self, job: Job) -> int:
        queue = self._queues.get(job.key)
        if not queue:
            return 0
        try:
            return queue.index(job)
        except ValueError:
            return 0

    def cancel(self, job: Job) -> bool:
        """Cancel a queued job (removed at once) or a running one (its worker is cancelled, for this job only).
        A job offered to the pool is cancelled only once its offer is taken back: claimed meanwhile by
        another daemon, it is handed over instead (`job.withdrawing` says the answer is to wait for)."""
        if job.task is not None:
            if job.finished or job.cancelled:
                return False
            job.cancelled = True  # the worker takes this cancel as the job's, not its own
            job.task.cancel()
            return True
        if job.offered:
            if not job.withdrawing:
                worker = self._workers.get(job.key)
                if job.ticket in self._offered and not job.claimed and worker is not None:
                    worker.cancel()  # waiting for a slot: woken in `_room` as a claim wakes it
                job.withdrawing = True
            return True
        return self._drop_queued(job)

    def _drop_queued(self, job: Job) -> bool:
        queue = self._queues.get(job.key)
        if queue is None or job not in queue:
            return False
        queue.remove(job)
        self._queued -= 1
        self._coming.discard(job.ticket)
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
                        self._room(job, held and not job.cancelled and bool(queue) and queue[0] is job) as room:
                    # taken over while this daemon was paused, or claimed by a daemon with a free slot
                    # while it waited for one here: the other daemon runs it
                    gone = not room or (not held and bool(queue) and queue[0] is job)
                    if gone and not job.cancelled and job in queue:
                        queue.remove(job)
                        self._queued -= 1
                        job.on_taken_over()
                    if gone or not held or job.cancelled or not queue or queue[0] is not job:
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

    @asynccontextmanager
    async def _room(self, job: Job, wanted: bool) -> AsyncIterator[bool]:
        """Hold the job's call slot for the block (True; none when not `wanted`); False, holding
        nothing, when it was offered to the pool while it waited for one and another daemon claimed it."""
        # a job this daemon claimed is never offered again: it came here because there was room,
        # and a request passed back and forth would have two runs of it on one daemon at once
        offerable = job.ticket not in self._coming
        self._coming.discard(job.ticket)
        if not wanted or not self._takes_slot(job.model):
            yield True
            return
        async with AsyncExitStack() as stack:
            self._wanting += 1
            offered = False
            try:
                offered = (offerable and not self._limits.has_room(job.model) and self._anyone_to_take()
                           and await self._offers.offer(job.ticket))
                if not offered:
                    await stack.enter_async_context(self._limits.slot(job.model))
            finally:
                if not offered:
                    self._wanting -= 1
            if not offered:
                stack.callback(self._on_room)
                yield True
                return
            worker = asyncio.current_task()
            assert worker is not None
            kept = True
            standing = True  # an offer that must be taken back before the job runs or is cancelled
            job.offered = True
            try:
                while not job.withdrawing:
                    # the word of a claim or a cancel wakes the worker only here, waiting for the slot:
                    # cancelled anywhere else (taking the offer back), it would drop its whole queue
                    self._offered[job.ticket] = job
                    try:
                        await stack.enter_async_context(self._limits.slot(job.model))
                        stack.callback(self._on_room)
                        break
                    except asyncio.CancelledError:
                        if not (job.claimed or job.withdrawing) or worker.cancelling() > 1:
                            raise
                        worker.uncancel()  # the claim's or the cancel's, spent
                    finally:
                        self._offered.pop(job.ticket, None)
                    # told it was claimed, or cancelled: the database says whether it still is this
                    # daemon's (the word of a claim may be late, about an earlier claim of a job offered again since)
                    job.claimed = False
                    kept = await self._offers.withdraw(job.ticket)
                    standing = False
                    if not kept or job.withdrawing:
                        break
                    await self._offers.offer(job.ticket)
                    standing = True
                if standing:
                    kept = await self._offers.withdraw(job.ticket)
            finally:
                self._wanting -= 1
                job.offered = False
            if kept and job.withdrawing:  # taken back: the cancel asked for while it stood is done now
                self._drop_queued(job)
                kept = False
            yield kept

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
