"""The JSONL backend as one `Storage`: every store over one var dir."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ksi_common.ids import random_hex
from ksi_common.privacy import private_dir
from ksi_common.settings import Settings
from ksi_daemon.storage.jsonl.agents import JsonlAgents
from ksi_daemon.storage.jsonl.blobs import JsonlBlobs
from ksi_daemon.storage.jsonl.calibration import JsonlCalibration
from ksi_daemon.storage.jsonl.consortia import JsonlConsortia, JsonlTraces
from ksi_daemon.storage.jsonl.conversations import JsonlConversations
from ksi_daemon.storage.jsonl.files import refused_link
from ksi_daemon.storage.jsonl.journal import JsonlJournal
from ksi_daemon.storage.jsonl.responses import JsonlResponses
from ksi_daemon.storage.jsonl.summaries import JsonlSummaries
from ksi_daemon.storage.ports import (
    LocalOnly,
    OneDaemonLeases,
    OneDaemonRates,
    OneDaemonRequests,
    OneDaemonSlots,
    SoleDaemon,
)


class JsonlStorage:
    def __init__(self, settings: Settings) -> None:
        layout = settings.layout
        fsync = settings.fsync_enabled
        self.layout = layout
        self.conversations = JsonlConversations(layout, fsync)
        self.responses = JsonlResponses(layout, fsync)
        self.agents = JsonlAgents(layout, fsync)
        self.consortia = JsonlConsortia(layout, fsync)
        self.traces = JsonlTraces(layout, fsync)
        self.journal = JsonlJournal(layout)
        self.summaries = JsonlSummaries(layout, fsync)
        self.calibration = JsonlCalibration(layout)
        self.blobs = JsonlBlobs(layout, fsync)
        self.relay = LocalOnly()  # the var dir's lock keeps every other daemon away
        self.daemon_id = random_hex(12)  # made at each start, as a shared backend's
        self.daemons = SoleDaemon(time.time)
        self.leases = OneDaemonLeases()
        self.slots = OneDaemonSlots()
        self.rates = OneDaemonRates(time.monotonic)
        self.requests = OneDaemonRequests()

    async def open(self) -> None:
        layout = self.layout
        for directory in (layout.responses_dir, layout.conversations_dir, layout.consortium_dir,
                          layout.state_dir, layout.exchange_log_dir):
            private_dir(directory)
        # the files are opened without following a link; the directories they are in are checked once here
        for directory in (layout.logs_dir, layout.responses_dir, layout.conversations_dir, layout.consortium_dir,
                          layout.summaries_dir, layout.state_dir, layout.conversation_meta_dir, layout.agents_dir,
                          layout.consortia_dir, layout.exchange_log_dir):
            if directory.is_symlink():
                raise refused_link(directory)
        await asyncio.to_thread(self.conversations.digests.prepare)  # before the replay appends to it
        await asyncio.to_thread(self.conversations.replay_log)  # exchanges a crash of the machine kept from their files
        await asyncio.to_thread(self.conversations.finish_imports)  # imports a kill interrupted

    async def close(self) -> None:
        await self.conversations.close()  # metadata whose totals wait to be saved
        await self.journal.close()

    def describe(self) -> dict[str, Any]:
        return {"backend": "jsonl", "var_dir": str(self.layout.root)}
