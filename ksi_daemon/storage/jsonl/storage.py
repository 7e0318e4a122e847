"""The JSONL backend as one `Storage`: every store over one var dir."""

from __future__ import annotations

import asyncio
from typing import Any

from ksi_common.settings import Settings
from ksi_common.privacy import private_dir
from ksi_daemon.storage.jsonl.agents import JsonlAgents
from ksi_daemon.storage.jsonl.calibration import JsonlCalibration
from ksi_daemon.storage.jsonl.consortia import JsonlConsortia, JsonlTraces
from ksi_daemon.storage.jsonl.conversations import JsonlConversations
from ksi_daemon.storage.jsonl.journal import JsonlJournal
from ksi_daemon.storage.jsonl.responses import JsonlResponses
from ksi_daemon.storage.jsonl.summaries import JsonlSummaries
from ksi_daemon.storage.ports import LocalOnly


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
        self.relay = LocalOnly()  # the var dir's lock keeps every other daemon away

    async def open(self) -> None:
        for directory in (self.layout.responses_dir, self.layout.conversations_dir, self.layout.consortium_dir,
                          self.layout.state_dir, self.layout.exchange_log_dir):
            private_dir(directory)
        await asyncio.to_thread(self.conversations.replay_log)  # exchanges a crash of the machine kept from their files
        await asyncio.to_thread(self.conversations.finish_imports)  # imports a kill interrupted

    async def close(self) -> None:
        await self.conversations.close()  # metadata whose totals wait to be saved
        await self.journal.close()

    def describe(self) -> dict[str, Any]:
        return {"backend": "jsonl", "var_dir": str(self.layout.root)}
