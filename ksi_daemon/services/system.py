"""`system:*` events: health, discovery, help and shutdown."""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable
from typing import Any

from pydantic import Field

from ksi_common import __version__
from ksi_daemon.context import EventContext
from ksi_daemon.events import EventData, NoData, Text
from ksi_daemon.router import Router, Unregister


class DiscoverData(EventData):
    namespace: Text | None = Field(default=None, description="only events of this namespace")
    level: Text | None = Field(default=None, description="accepted from older clients; every level lists the same")


class HelpData(EventData):
    event: Text = Field(description="the event to describe, e.g. completion:async")


class SystemService:
    def __init__(
        self,
        router: Router,
        request_shutdown: Callable[[], None],
        health_sections: dict[str, Callable[[], Any]],
        settings_view: Callable[[], dict[str, Any]],
    ) -> None:
        self.router = router
        self.request_shutdown = request_shutdown
        self.health_sections = health_sections
        self.settings_view = settings_view
        self.started = time.monotonic()

    def register(self) -> list[Unregister]:
        r = self.router
        return [
            r.register("system:health", self.health, NoData, "Daemon status, version, uptime and counts."),
            r.register("system:discover", self.discover, DiscoverData, "Every event with its one-line description."),
            r.register("system:help", self.help, HelpData, "Fields, types and defaults of one event."),
            r.register("system:config", self.config, NoData, "The running daemon's effective settings, secrets masked."),
            r.register("system:shutdown", self.shutdown, NoData, "Stop gracefully: drain work, flush files, remove the socket."),
        ]

    async def health(self, _data: NoData, _context: EventContext) -> dict[str, Any]:
        report: dict[str, Any] = {
            "status": "healthy",
            "version": __version__,
            "uptime": round(time.monotonic() - self.started, 3),
            "pid": os.getpid(),
            "memory_rss_mb": _rss_mb(),
        }
        for name, section in self.health_sections.items():
            report[name] = section()
        return report

    async def discover(self, data: DiscoverData, _context: EventContext) -> dict[str, Any]:
        events = {route.name: route.description for route in self.router.events(data.namespace)}
        return {"events": events, "count": len(events)}

    async def help(self, data: HelpData, _context: EventContext) -> dict[str, Any]:
        return self.router.describe(data.event)

    async def config(self, _data: NoData, _context: EventContext) -> dict[str, Any]:
        return self.settings_view()

    async def shutdown(self, _data: NoData, _context: EventContext) -> dict[str, Any]:
        self.request_shutdown()
        return {"status": "shutting_down"}


def _rss_mb() -> float:
    """Resident memory now (from /proc where there is one, else the peak the kernel reports)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            pages = int(statm.read().split()[1])
        return round(pages * os.sysconf("SC_PAGE_SIZE") / 1048576, 1)
    except (OSError, ValueError, IndexError):
        return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
