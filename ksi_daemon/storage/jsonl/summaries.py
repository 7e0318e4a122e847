"""Conversation summaries, one append-only JSONL file per conversation under `logs/summaries/`;
the `SummaryStore` port."""

from __future__ import annotations

import asyncio

from ksi_common.layout import VarLayout
from ksi_common.reading import JsonlFiles
from ksi_common.summaries import Summary
from ksi_daemon.storage.jsonl.files import append_lines, jsonl


class JsonlSummaries:
    def __init__(self, layout: VarLayout, fsync: bool) -> None:
        self.layout = layout
        self.fsync = fsync
        self.files = JsonlFiles(layout)

    def append_now(self, summary: Summary) -> None:
        self.layout.summaries_dir.mkdir(parents=True, exist_ok=True)
        append_lines(self.layout.summaries_file(summary.conversation_id), jsonl([summary.to_record()]), self.fsync)

    async def append(self, summary: Summary) -> None:
        await asyncio.to_thread(self.append_now, summary)

    async def read(self, conversation_id: str) -> list[Summary]:
        return await asyncio.to_thread(self.files.summaries, conversation_id)
