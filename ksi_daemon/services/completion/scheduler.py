"""Per-conversation FIFO order, global and per-model concurrency, and nothing kept for idle
conversations: a conversation has a queue and a worker only while it has requests.

Daemons sharing a database keep one order per conversation between them: a job takes its place
in the conversation's line when it is submitted and runs while it holds the conversation's lease
(the storage's `ConversationLeases`), taken before a concurrency slot, so a job waiting for
another daemon's turn holds no slot. A conversation's queue here is in the order of those places:
a job taken over or claimed from another daemon keeps its place, ahead of later ones.

A job holding its lease asks the pool where it runs (`Placement.place`): here, holding a slot,
or handed over to a daemon that claimed it; one handed over leaves this daemon's queue as a job
taken over does. Its state is its `PooledTurn`'s."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import structlog

from ksi_daemon.services.limits import ConcurrencyLimits
from ksi_daemon.services.pool.placement import Place, Placement
from ksi_daemon.services.pool.turn import PooledTurn, TurnState
from ksi_daemon.storage.ports import ConversationLeases, OneDaemonLeases, OneDaemonRequests, PoolRequests

log = structlog.get_logger("ksi.scheduler")

RELEASE_WAIT = 2.0  # seconds a stop gives the workers to give back their leases before cancelling them


@dataclass(eq=False)
class Job:
    key: str  # the conversation the job belongs to
    model: str
    run: Callable[[], Awaitable[Any]]
    on_cancel_queued: Callable[[], None]
    ticket: str  # names its place in the conversation's line (the request id)
    place: int = 0  # its place in the line: the conversation's jobs run in this order
    on_taken_over: Callable[[], None] = lambda: None  # another daemon of the pool runs it now
    task: asyncio.Task[Any] | None = None  # the job's run, once it started
    turn: PooledTurn = field(default_factory=PooledTurn)
    meta: dict[str, Any] = field(default_factory=dict)


class Scheduler:
    def __init__(self, limits: ConcurrencyLimits, takes_slot: Callable[[str], bool] = lambda _model: True,
                 leases: ConversationLeases | None = None, offers: PoolRequests | None = None) -> None:
        self._limits = limits
        self._leases: ConversationLeases = leases or OneDaemonLeases()
        self._pool = Placement(limits, offers or OneDaemonRequests())
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
        return self._limits.capacity - self._limits.in_use - self._pool.wanting - len(self._pool.coming)

    async def leave_line(self, key: str, ticket: str) -> None:
        """Give up a place taken in a conversation's line by a job that was never submitted."""
        await self._leases.leave_line(key, ticket)

    def full_models(self) -> list[str]:
        """Models a job claimed now would wait for: their own slots here are all taken."""
        return self._limits.full_models()

    def expect(self, ticket: str) -> None:
        """A job claimed from another daemon is on its way here: counted as wanting a slot already."""
        self._pool.coming.add(ticket)

    def unexpect(self, ticket: str) -> None:
        self._pool.coming.discard(ticket)

    def when_room(self, call: Callable[[], None]) -> None:
        """Call `call` whenever a job here gives its slot back."""
        self._pool.on_room = call

    def offer_when(self, anyone_to_take: Callable[[], bool]) -> None:
        """Offer waiting jobs only while `anyone_to_take()`: alone, an offer costs two round trips for nothing."""
        self._pool.anyone_to_take = anyone_to_take

    def claimed(self, ticket: str) -> None:
        """Another daemon claimed the job offered under `ticket`: it stops waiting for a slot here."""
        self._pool.claimed(ticket)

    def position(self, job: Job) -> int:
        queue = self._queues.get(job.key)
        if not queue:
            return 0
        try:
            return queue.index(job)
        except ValueError:
            return 0

    def cancel(self, job: Job) -> bool:
        """Cancel a queued job (removed at once) or a running one (its own task is cancelled).
        A job offered to the pool is cancelled only once its offer is withdrawn: claimed meanwhile by
        another daemon, it is handed over instead (its turn WITHDRAWN says the answer is to wait for)."""
        if job.task is not None:
            if job.turn.over:
                return False
            job.turn.end()  # ended while running: its run unwinds
            job.task.cancel()
            return True
        if job.turn.offered:
            if job.turn.state is not TurnState.WITHDRAWN:
                job.turn.withdraw()  # the word wakes its wait for a slot, as a claim's does
            return True
        return self._drop_queued(job)

    def _drop_queued(self, job: Job) -> bool:
        queue = self._queues.get(job.key)
        if queue is None or job not in queue:
            return False
        queue.remove(job)
        self._queued -= 1
        self._pool.coming.discard(job.ticket)
        if not job.turn.over:
            job.turn.end()
        job.on_cancel_queued()
        leaving = asyncio.get_running_loop().create_task(self._leases.leave_line(job.key, job.ticket))
        self._leaving.add(leaving)
        leaving.add_done_callback(self._leaving.discard)
        return True

    async def _work(self, key: str, queue: deque[Job]) -> None:
        """Run the conversation's jobs one after another, each in a task of its own: a job's cancel
        cancels its task, and this worker goes on to the next job."""
        worker = asyncio.current_task()
        assert worker is not None
        try:
            while queue:
                job = queue[0]
                async with self._leases.hold(job.key, job.ticket) as held, \
                        self._where(job, held and not job.turn.over and bool(queue) and queue[0] is job) as place:
                    # taken over while this daemon was paused, or claimed by a daemon with a free slot
                    # while it waited for one here: the other daemon runs it
                    gone = place is not Place.HERE or (not held and bool(queue) and queue[0] is job)
                    if gone and not job.turn.over and job in queue:
                        queue.remove(job)
                        self._queued -= 1
                        job.turn.hand_over()
                        job.on_taken_over()
                    if gone or not held or job.turn.over or not queue or queue[0] is not job:
                        if job.turn.state is TurnState.WAITING:  # another was let ahead of it
                            job.turn.back_in_line()
                        continue
                    await self._run(job, worker)
                if queue and queue[0] is job:
                    queue.popleft()
                    self._queued -= 1
        finally:
            self._queued -= len(queue)  # jobs left when the worker is cancelled leave with their queue
            self._queues.pop(key, None)
            self._workers.pop(key, None)

    async def _run(self, job: Job, worker: asyncio.Task[None]) -> None:
        self.running += 1
        job.turn.run()
        # the job's own task: its cancel cancels that task, never the conversation's worker
        job.task = asyncio.get_running_loop().create_task(job.run())
        try:
            await job.task
        except asyncio.CancelledError:
            if worker.cancelling():
                raise  # the worker itself is being cancelled (the scheduler stops), and the job with it
        except Exception:
            log.exception("job_failed", conversation_id=job.key)
        finally:
            self.running -= 1
            if not job.turn.over:
                job.turn.end()

    @asynccontextmanager
    async def _where(self, job: Job, wanted: bool) -> AsyncIterator[Place]:
        """Where the job runs, asked of the pool when it wants a slot: here (its slot held for the
        block), handed over, or cancelled while it was offered."""
        if not wanted or not self._takes_slot(job.model):
            self._pool.coming.discard(job.ticket)
            yield Place.HERE
            return
        async with self._pool.place(job.turn, job.ticket, job.model) as place:
            if place is Place.CANCELLED:  # withdrawn: the cancel asked for while it stood is done now
                self._drop_queued(job)
            yield place

    def jobs(self) -> list[Job]:
        return [job for queue in self._queues.values() for job in queue]

    async def stop(self, timeout: float) -> None:
        """Cancel queued jobs, give running ones `timeout` seconds, then cancel them."""
        for queue in self._queues.values():
            for job in list(queue)[1:]:
                self.cancel(job)
        running = [job.task for job in self.jobs() if job.task is not None and not job.task.done()]
        if running:  # only the running job is left in each queue: its worker ends with it
            _done, pending = await asyncio.wait(running, timeout=timeout)
            for task in pending:
                task.cancel()
        for queue in self._queues.values():
            for job in list(queue):
                if job.task is None:
                    self.cancel(job)
        workers = list(self._workers.values())
        if not workers:
            return
        # a worker whose job has ended is giving back the conversation's lease: a release cut short
        # keeps the next daemon on this storage from the conversation until the lease runs out
        _done, pending = await asyncio.wait(workers, timeout=RELEASE_WAIT)
        for worker in pending:
            worker.cancel()
        if pending:
            await asyncio.wait(pending, timeout=1.0)
