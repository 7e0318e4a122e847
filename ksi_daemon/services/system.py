"""`system:*` events: health, discovery, help and shutdown."""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable
from typing import Any

from pydantic import Field

from ksi_common import __version__
from ksi_common.events import SYSTEM_CONFIG, SYSTEM_DISCOVER, SYSTEM_HEALTH, SYSTEM_HELP, SYSTEM_SHUTDOWN
from ksi_daemon.context import EventContext
from ksi_daemon.events import EventData, NoData, Text
from ksi_daemon.router import Router, Unregister


class DiscoverData(EventData):
    namespace: Text | None = Field(default=None, description="only events of this namespace")
    level: Text | None = Field(default=None, description="accepted from older clients; every level lists the same")


class ConfigData(EventData):
    origins: bool = Field(default=False, description="answer {settings, origins, config_file}: where each value came from")


class HelpData(EventData):
    event: Text = Field(description="the event to describe, e.g. completion:async")


class SystemService:
    def __init__(
        self,
        router: Router,
        request_shutdown: Callable[[], None],
        health_sections: dict[str, Callable[[], Any]],
        settings_view: Callable[[], dict[str, Any]],
        settings_origins: Callable[[], dict[str, Any]] = dict,
    ) -> None:
        self.router = router
        self.request_shutdown = request_shutdown
        self.health_sections = health_sections
        self.settings_view = settings_view
        self.settings_origins = settings_origins
        self.started = time.monotonic()
        self.pid = os.getpid()
        self.memory = ResidentMemory()

    def register(self) -> list[Unregister]:
        r = self.router
        return [
            r.register(SYSTEM_HEALTH, self.health, NoData, "Daemon status, version, uptime and counts."),
            r.register(SYSTEM_DISCOVER, self.discover, DiscoverData, "Every event with its one-line description."),
            r.register(SYSTEM_HELP, self.help, HelpData, "Fields, types and defaults of one event."),
            r.register(SYSTEM_CONFIG, self.config, ConfigData,
                       "The running daemon's effective settings, secrets masked (and where each came from)."),
            r.register(SYSTEM_SHUTDOWN, self.shutdown, NoData, "Stop gracefully: drain work, flush files, remove the socket."),
        ]

    async def health(self, _data: NoData, _context: EventContext) -> dict[str, Any]:
        report: dict[str, Any] = {
            "status": "healthy",
            "version": __version__,
            "uptime": round(time.monotonic() - self.started, 3),
            "pid": self.pid,
            "memory_rss_mb": self.memory.megabytes(),
        }
        for name, section in self.health_sections.items():
            report[name] = section()
        return report

    async def discover(self, data: DiscoverData, _context: EventContext) -> dict[str, Any]:
        events = {route.name: route.description for route in self.router.events(data.namespace)}
        if data.namespace and not events:  # a misspelt namespace lists nothing: say which was meant
            similar = self.router.similar_namespaces(data.namespace.rstrip(":*"))
            if similar:
                return {"events": events, "count": 0, "similar": similar}
        return {"events": events, "count": len(events)}

    async def help(self, data: HelpData, _context: EventContext) -> dict[str, Any]:
        return self.router.describe(data.event)

    async def config(self, data: ConfigData, _context: EventContext) -> dict[str, Any]:
        if data.origins:
            return {"settings": self.settings_view(), **self.settings_origins()}
        return self.settings_view()

    async def shutdown(self, _data: NoData, _context: EventContext) -> dict[str, Any]:
        self.request_shutdown()
        return {"status": "shutting_down"}

    async def stop(self, timeout: float) -> None:
        self.memory.close()


class ResidentMemory:
    """The process's resident memory now, from /proc/self/statm read through one descriptor kept
    open: each health reply then costs one pread instead of the nine system calls of opening the
    file (on a VM they were half the daemon's CPU per round trip). Where there is no /proc, and
    once closed (health is still answered while the daemon drains), the peak the kernel reports."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self._closed = False
        self._page = os.sysconf("SC_PAGE_SIZE")

    def megabytes(self) -> float:
        if not self._closed:
            try:
                if self._fd is None:
                    self._fd = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)
                pages = int(os.pread(self._fd, 128, 0).split()[1])  # offset 0: the kernel writes it afresh
                return round(pages * self._page / 1048576, 1)
            except (OSError, ValueError, IndexError):
                pass
        return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)

    def close(self) -> None:
        self._closed = True
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
