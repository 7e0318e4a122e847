"""Taking over the requests of a daemon of the pool that died, and cancelling this daemon's
requests when another daemon was asked to.

Every heartbeat interval this daemon claims the unfinished requests of daemons whose heartbeat is
older than the timeout (`PoolRequests.take_over`, one transaction: one daemon gets each): a request
whose exchange was indexed is reported done from storage, never run again; any other is run here
with its own ids, keeping its place in its conversation's line. With one daemon (JSONL) nothing is ever
taken over, and a restart reports what its journal left unfinished, as before. A daemon whose own
heartbeat is late (its loop was starved, the database away) takes over nothing until it beat again,
nor, after its heartbeat failed (the database restarted), until the others had the timeout to beat.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import structlog

from ksi_common.errors import KsiError
from ksi_common.settings import Settings
from ksi_daemon.background import one_round, stop_task
from ksi_daemon.context import EventContext
from ksi_daemon.router import Unregister
from ksi_daemon.services.completion.models import CompletionCancel
from ksi_daemon.services.completion.service import CompletionService
from ksi_daemon.storage.ports import PoolRequests

log = structlog.get_logger("ksi.pool")


class TakeoverService:
    def __init__(self, settings: Settings, requests: PoolRequests, completion: CompletionService,
                 shared: bool, own_silence: Callable[[], float],
                 steady_for: Callable[[], float] = lambda: float("inf")) -> None:
        self.requests = requests
        self.own_silence = own_silence  # seconds since this daemon's own last heartbeat
        self.steady_for = steady_for  # seconds since its heartbeat came back after failing
        self.completion = completion
        self.interval = settings.heartbeat_interval
        self.stale_after = settings.heartbeat_stale_after
        self.shared = shared  # only a backend other daemons share has requests to take over
        self._task: asyncio.Task[None] | None = None

    def register(self) -> list[Unregister]:
        return []

    async def start(self) -> None:
        if self.shared:
            self._task = asyncio.get_running_loop().create_task(self._watching())

    async def stop(self, timeout: float) -> None:
        task, self._task = self._task, None
        await stop_task(task)

    async def _watching(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await one_round(self.round, "takeover_round", log)

    async def round(self) -> None:
        """Take over what dead daemons left; cancel what another daemon was asked to cancel here."""
        if self.own_silence() > 2 * self.interval or self.steady_for() < self.stale_after:
            # this daemon was starved or cut off itself (the database restarted): the others'
            # heartbeats may be as late as its own, and it would take over daemons that are alive;
            # judge once they had the timeout to beat again
            return
        for taken in await self.requests.take_over(self.stale_after):
            log.warning("request_taken_over", request_id=taken.request_id, conversation_id=taken.conversation_id,
                        indexed=taken.indexed)
            try:
                await self.completion.adopt(taken)
            except Exception:
                log.exception("takeover_failed", request_id=taken.request_id)
        for request_id in await self.requests.cancels_asked():
            with contextlib.suppress(KsiError):
                await self.completion.handle_cancel(CompletionCancel(request_id=request_id), EventContext.root())
