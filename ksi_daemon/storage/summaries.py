"""Conversation summaries, one append-only JSONL file per conversation under var/logs/summaries/."""

from __future__ import annotations

from ksi_common.layout import VarLayout
from ksi_common.summaries import Summary, read_summaries
from ksi_daemon.storage.files import append_lines, jsonl


class SummaryLog:
    """Blocking file operations on summaries; callers run them off the event loop."""

    def __init__(self, layout: VarLayout, fsync: bool) -> None:
        self.layout = layout
        self.fsync = fsync

    def append(self, summary: Summary) -> None:
        self.layout.summaries_dir.mkdir(parents=True, exist_ok=True)
        append_lines(self.layout.summaries_file(summary.conversation_id), jsonl([summary.to_record()]), self.fsync)

    def read(self, conversation_id: str) -> list[Summary]:
        return read_summaries(self.layout.summaries_file(conversation_id))
