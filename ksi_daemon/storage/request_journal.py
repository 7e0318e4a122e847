"""A journal of request states, so work interrupted by a crash is reported after restart."""

from __future__ import annotations

import os
from itertools import islice
from typing import Any

import orjson

from ksi_common.jsonl import iter_lines_reversed, read_records
from ksi_common.layout import VarLayout
from ksi_common.records import parse_index_line, read_response
from ksi_common.timefmt import utc_now
from ksi_daemon.storage.files import append_lines, jsonl


class RequestJournal:
    def __init__(self, layout: VarLayout) -> None:
        self.layout = layout
        self.path = layout.requests_file
        self._fd: int | None = None  # kept open: three lines a request, a reopen each is waste

    def record(self, request_id: str, conversation_id: str, status: str, response_id: str | None = None,
               code: str | None = None) -> None:
        line = {"v": 1, "request_id": request_id, "conversation_id": conversation_id,
                "status": status, "ts": utc_now()}
        if response_id is not None:
            line["response_id"] = response_id
        if code is not None:
            line["code"] = code
        payload = orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE)
        if self._fd is None:
            append_lines(self.path, payload, fsync=False)  # repairs a torn tail first
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        else:
            os.write(self._fd, payload)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def recover(self) -> list[dict[str, Any]]:
        """Every request the journal knows, finished ones as they ended and unfinished ones now
        failed (or done when indexed); the journal is compacted to the most recent of them, so
        `completion:status` still answers for finished requests after a restart."""
        self.close()  # the file is replaced below
        last: dict[str, dict[str, Any]] = {}
        for line in read_records(self.path):
            if "request_id" in line:  # later lines win; the `running` line's response_id is kept
                last[line["request_id"]] = {**last.get(line["request_id"], {}), **line}
        interrupted = []
        for line in last.values():
            if line.get("status") not in ("queued", "running"):
                continue
            # Killed after the index line was written but before `done` was journaled: the
            # exchange is in the history, so the request is done (a retry would duplicate it).
            result = self._indexed_result(line)
            if result is not None:
                interrupted.append({**line, "status": "done", "recovered": True, "result": result, "ts": utc_now()})
            else:
                interrupted.append({**line, "status": "failed", "code": "daemon_restart", "ts": utc_now()})
        finished = [line for line in last.values() if line.get("status") in ("done", "failed", "cancelled")]
        kept = (finished + interrupted)[-10_000:]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_bytes(jsonl(kept))
        tmp.replace(self.path)
        return kept

    def _indexed_result(self, line: dict[str, Any]) -> dict[str, Any] | None:
        """The result data of a `running` request whose exchange made it into its index, else None."""
        response_id, conversation_id = line.get("response_id"), line.get("conversation_id")
        if line.get("status") != "running" or not response_id or not conversation_id:
            return None
        # one writer per conversation: a request that was running is at the index's very end
        for raw in islice(iter_lines_reversed(self.layout.index_file(conversation_id)), 8):
            entry = parse_index_line(raw, 0)
            if entry is None or entry.response_id != response_id:
                continue
            record = read_response(self.layout.response_file(response_id))
            if record is None or not record.ok or record.outcome is None:
                return None
            outcome = record.outcome
            agent_id = next((i.get("agent_id") for i in record.inputs if i.get("agent_id")), None)
            return {
                "request_id": line["request_id"], "response_id": response_id, "conversation_id": conversation_id,
                "agent_id": agent_id, "model": outcome.get("model"), "content": record.content,
                "finish_reason": outcome.get("finish_reason"), "usage": outcome.get("usage") or {},
                "cost": outcome.get("cost"), "history": {}, "attempts": len(outcome.get("attempts") or []),
                "duration_ms": outcome.get("duration_ms"), "exchange": entry.n or None, "recovered": True,
            }
        return None
