"""A journal of request states, so work interrupted by a crash is reported after restart."""

from __future__ import annotations

from typing import Any

import orjson

from ksi_common.jsonl import read_records
from ksi_common.layout import VarLayout
from ksi_common.timefmt import utc_now
from ksi_daemon.storage.files import append_lines, jsonl


class RequestJournal:
    def __init__(self, layout: VarLayout) -> None:
        self.path = layout.requests_file

    def record(self, request_id: str, conversation_id: str, status: str) -> None:
        line = {"v": 1, "request_id": request_id, "conversation_id": conversation_id,
                "status": status, "ts": utc_now()}
        append_lines(self.path, orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE), fsync=False)

    def recover(self) -> list[dict[str, Any]]:
        """Requests that never finished; the journal is compacted to just those, now failed."""
        last: dict[str, dict[str, Any]] = {}
        for line in read_records(self.path):
            if "request_id" in line:
                last[line["request_id"]] = line
        interrupted = [
            {**line, "status": "failed", "code": "daemon_restart", "ts": utc_now()}
            for line in last.values()
            if line.get("status") in ("queued", "running")
        ]
        earlier = [line for line in last.values() if line.get("code") == "daemon_restart"]
        kept = (earlier + interrupted)[-10_000:]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_bytes(jsonl(kept))
        tmp.replace(self.path)
        return kept
