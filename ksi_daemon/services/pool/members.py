"""The pool: every daemon serving the same storage, as its registry reports them.

This daemon registers itself at start, beats every `heartbeat_interval` seconds with its load, and
reads the whole list back on each beat: health and `system:cluster` answer from that copy, never
with a query of their own. A beat that fails (the database is away) is logged and tried again at
the next interval; the daemon goes on serving. A daemon whose row is gone (pruned while it was
paused) is registered again by its next beat. A clean stop removes the row.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import structlog

from ksi_common import __version__
from ksi_common.errors import KsiError
from ksi_common.events import SYSTEM_CLUSTER
from ksi_common.settings import Settings
from ksi_daemon.background import stop_task
from ksi_daemon.context import EventContext
from ksi_daemon.events import NoData
from ksi_daemon.router import Router, Unregister
from ksi_daemon.storage.ports import DaemonInfo, DaemonRegistry, PoolMember

log = structlog.get_logger("ksi.pool")

PRUNE_AFTER = 3600.0  # seconds: a daemon silent this long is gone, not paused; any daemon removes its row
LEAVE_WAIT = 2.0  # seconds a clean stop gives the database to remove this daemon's row

Load = Callable[[], tuple[int, int, int]]  # (in flight, queued) requests of this daemon now, leases it holds


class PoolService:
    def __init__(self, settings: Settings, router: Router, registry: DaemonRegistry, daemon_id: str, load: Load,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.router = router
        self.registry = registry
        self.load = load
        self.clock = clock
        self.interval = settings.heartbeat_interval
        self.stale_after = settings.heartbeat_stale_after
        self.me = DaemonInfo(daemon_id=daemon_id, host=socket.gethostname(), pid=os.getpid(),
                             version=__version__)
        self.started = clock()
        self._members: list[PoolMember] = []
        self._read_at: float | None = None  # when `_members` was read (this process's monotonic clock)
        self._error: str | None = None  # why the last beat failed; None once one succeeds
        self._recovered_at: float | None = None  # when a beat first succeeded after failing ones
        self._task: asyncio.Task[None] | None = None
        self._shown: tuple[int, dict[str, Any]] | None = None  # (tenth of a second, section); None: rebuild

    def register(self) -> list[Unregister]:
        return [self.router.register(SYSTEM_CLUSTER, self.cluster, NoData,
                                     "The daemons serving this storage: load, last heartbeat, alive or stale.")]

    async def start(self) -> None:
        await self.beat()  # listed from the first health reply on
        self._task = asyncio.get_running_loop().create_task(self._beating())

    async def stop(self, timeout: float) -> None:
        task, self._task = self._task, None
        await stop_task(task)
        try:
            await asyncio.wait_for(self.registry.leave(self.me.daemon_id), LEAVE_WAIT)
        except (KsiError, TimeoutError) as exc:  # the row goes stale, then is pruned by the others
            log.warning("pool_leave_failed", error=exc.message if isinstance(exc, KsiError) else "timed out")

    async def _beating(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.beat()
            except Exception:  # an unforeseen failure must not end the heartbeat for good
                log.exception("heartbeat_crashed")

    async def beat(self) -> None:
        """Record this daemon's heartbeat and load, then read the pool back; a failure is kept for
        health to show and logged, never raised: the next interval tries again."""
        in_flight, queued, leases = self.load()
        try:
            # a beat slower than the timeout would be too late to count: give up and try the next one
            async with asyncio.timeout(self.stale_after):
                registered = await self.registry.beat(self.me, self.clock() - self.started, in_flight, queued,
                                                 leases)
                members = await self.registry.members(self.stale_after, PRUNE_AFTER)
        except (KsiError, TimeoutError) as exc:
            message = exc.message if isinstance(exc, KsiError) else "the heartbeat timed out"
            if self._error is None:
                log.warning("heartbeat_failed", error=message)
            self._error, self._shown = message, None
            return
        if registered and self._read_at is not None:
            log.warning("daemon_registered_again", daemon_id=self.me.daemon_id)
        elif registered:
            log.info("daemon_registered", daemon_id=self.me.daemon_id, shared=self.registry.shared)
        if self._error is not None:
            log.info("heartbeat_recovered")
            self._recovered_at = self.clock()
        self._members, self._read_at, self._error, self._shown = members, self.clock(), None, None

    def others_alive(self) -> bool:
        """Whether another daemon of the pool was alive at the last heartbeat."""
        return any(m.daemon_id != self.me.daemon_id and not m.stale for m in self._members)

    def steady_for(self) -> float:
        """Seconds since this daemon's heartbeat last came back after failing (inf: it never failed):
        while the database was away, every daemon's heartbeat failed alike."""
        return self.clock() - self._recovered_at if self._recovered_at is not None else float("inf")

    def silent_for(self) -> float:
        """Seconds since this daemon's last heartbeat that reached the registry (inf before the first)."""
        return self.clock() - self._read_at if self._read_at is not None else float("inf")

    def health(self) -> dict[str, Any]:
        """The pool as last read; ages and states carried forward to now on this host's monotonic clock
        (to a tenth of a second: the section is built once per tenth, not once per health request)."""
        now = self.clock()
        tick = int(now * 10)
        if self._shown is None or self._shown[0] != tick:
            self._shown = (tick, self._section(now))
        return self._shown[1]

    def _section(self, now: float) -> dict[str, Any]:
        since = now - self._read_at if self._read_at is not None else 0.0
        daemons = []
        for member in self._members:
            age = member.heartbeat_age + since
            daemons.append({
                "daemon_id": member.daemon_id, "host": member.host, "pid": member.pid, "version": member.version,
                "started": member.started, "heartbeat_age": round(age, 3),
                "in_flight": member.in_flight, "queued": member.queued, "leases": member.leases,
                "state": "stale" if member.stale or age > self.stale_after else "alive",
                "this": member.daemon_id == self.me.daemon_id,
            })
        return {
            "this": self.me.daemon_id,
            "shared": self.registry.shared,
            "heartbeat_interval": self.interval,
            "heartbeat_timeout": self.stale_after,
            "read_age": round(since, 3) if self._read_at is not None else None,
            "error": self._error,
            "daemons": daemons,
        }

    async def cluster(self, _data: NoData, _context: EventContext) -> dict[str, Any]:
        return self.health()
