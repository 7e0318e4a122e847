"""Response files: one per request, the raw inputs then the outcome, written whole."""

from __future__ import annotations

from typing import Any

from ksi_common.layout import VarLayout
from ksi_common.records import ResponseRecord, read_response
from ksi_daemon.storage.files import jsonl, write_new


class ResponseLog:
    def __init__(self, layout: VarLayout, fsync: bool) -> None:
        self.layout = layout
        self.fsync = fsync

    def write(self, response_id: str, records: list[dict[str, Any]]) -> None:
        """Write the whole response file, durable before the caller indexes it."""
        write_new(self.layout.response_file(response_id), jsonl(records), self.fsync)

    def read(self, response_id: str) -> ResponseRecord | None:
        return read_response(self.layout.response_file(response_id))
