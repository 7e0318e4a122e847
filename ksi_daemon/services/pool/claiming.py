"""Work goes where there is room: this daemon claims the turns other daemons of the pool offered
while they waited for a call slot, whenever it has a free one.

A daemon at its limits offers each turn that holds its conversation's lease but finds no free slot
(see `placement`). Every daemon hears the offers (a notification from the database) and, while
it has room, claims the oldest one (`PoolRequests.claim_offered`, one statement: one daemon gets
each) and runs it as a request taken over: the same ids, its place in its conversation's line
kept, its result reaching clients waiting on the daemon that accepted it. It looks again when one
of its own calls ends, while offers were heard since it last found none, and every few heartbeat
intervals in case a notification was missed (the database restarted). With one daemon (JSONL)
nothing is offered and nothing runs here; on a shared database nothing is offered while no other
daemon is alive (each offer costs two round trips).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import structlog

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.settings import Settings
from ksi_daemon.background import one_round, stop_task
from ksi_daemon.router import Unregister
from ksi_daemon.services.completion.service import CompletionService
from ksi_daemon.storage.ports import PoolRequest, PoolRequests

log = structlog.get_logger("ksi.pool")

UNHEARD_LOOK = 5  # heartbeat intervals between two looks when no offer was heard


class OfferClaims:
    def __init__(self, settings: Settings, requests: PoolRequests, completion: CompletionService,
                 shared: bool, others_alive: Callable[[], bool]) -> None:
        self.requests = requests
        self.completion = completion
        self.scheduler = completion.scheduler
        self.interval = settings.heartbeat_interval
        self.shared = shared  # only daemons sharing a backend have work to share
        self.others_alive = others_alive  # as the last heartbeat read the pool
        self._wake = asyncio.Event()
        self._offers_heard = False  # since the last look found nothing
        self._task: asyncio.Task[None] | None = None

    def register(self) -> list[Unregister]:
        return []

    async def start(self) -> None:
        if not self.shared:
            return
        self.requests.watch(self._heard)
        self.scheduler.when_room(self._room_freed)
        self.scheduler.offer_when(self.others_alive)
        self._task = asyncio.get_running_loop().create_task(self._claiming())

    async def stop(self, timeout: float) -> None:
        task, self._task = self._task, None
        await stop_task(task)

    def _heard(self, news: str, request_id: str) -> None:
        if news == "taken":  # maybe one of this daemon's: it stops waiting for a slot here
            self.scheduler.claimed(request_id)
        elif news == "offered":
            self._offers_heard = True
            self._wake.set()

    def _room_freed(self) -> None:
        if self._offers_heard:
            self._wake.set()

    async def _claiming(self) -> None:
        unheard = 0
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval)
            self._wake.clear()
            unheard = 0 if self._offers_heard else unheard + 1
            if not self._offers_heard and unheard < UNHEARD_LOOK:
                continue
            unheard = 0
            await one_round(self.claim_offers, "claim", log)

    async def claim_offers(self) -> None:
        """Claim offered turns while this daemon has room for them."""
        while self.scheduler.room() > 0:
            taken = await self.requests.claim_offered(self.scheduler.full_models())
            if taken is None:
                self._offers_heard = False
                return
            log.info("request_claimed", request_id=taken.request_id, conversation_id=taken.conversation_id)
            self.scheduler.expect(taken.request_id)
            try:
                await self.completion.adopt(taken)
            except asyncio.CancelledError:  # stopping: left open, taken over once this daemon is silent
                self.scheduler.unexpect(taken.request_id)
                raise
            except Exception as exc:
                self.scheduler.unexpect(taken.request_id)
                await self._not_adopted(taken, exc)
                raise

    async def _not_adopted(self, taken: PoolRequest, exc: Exception) -> None:
        """The claim committed but the turn could not be queued here: its row is ended as failed and its
        ticket leaves the line, or its conversation's later turns and the client waiting on the daemon
        that accepted it would wait for it forever."""
        code = exc.code if isinstance(exc, KsiError) else str(ErrorCode.INTERNAL_ERROR)
        log.warning("request_claimed_not_run", request_id=taken.request_id, code=code)
        self.requests.ended(taken.request_id, "failed", code)  # a no-op when adopt had ended it already
        await self.scheduler.leave_line(taken.conversation_id, taken.request_id)
