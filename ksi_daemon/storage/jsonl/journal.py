"""The request journal `state/requests.jsonl`: a line per request state, so work interrupted by a
crash is reported after a restart; the `RequestJournal` port."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import orjson
import structlog

from ksi_common.errors import KsiError
from ksi_common.jsonl import read_records
from ksi_common.layout import VarLayout
from ksi_common.timefmt import utc_now
from ksi_daemon.storage.jsonl.files import append_lines, jsonl, replace_file

log = structlog.get_logger("ksi.storage.journal")


class JsonlJournal:
    def __init__(self, layout: VarLayout) -> None:
        self.path = layout.requests_file
        self._fd: int | None = None  # kept open: two lines a request, a reopen each is waste

    def record(self, request_id: str, conversation_id: str, status: str, response_id: str | None = None,
               code: str | None = None, model: str | None = None) -> None:
        """An unsynced append of a few dozen bytes: cheap enough to do on the loop."""
        now = utc_now()
        line = {"v": 1, "request_id": request_id, "conversation_id": conversation_id, "status": status, "ts": now}
        if status == "queued":  # `ts` is overwritten by the request's later lines when they are merged
            line["queued_at"] = now
        if model is not None:
            line["model"] = model
        if response_id is not None:
            line["response_id"] = response_id
        if code is not None:
            line["code"] = code
        payload = orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE)
        try:
            if self._fd is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                append_lines(self.path, payload, fsync=False)  # repairs a torn tail first
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW)
            else:
                os.write(self._fd, payload)
        except (OSError, KsiError) as exc:
            # the journal only reports work a crash interrupted: a full disk must not fail the
            # request itself (its response and index writes report storage_full on their own)
            log.warning("journal_write_failed", request_id=request_id, status=status, error=str(exc)[:200])

    async def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _states(self) -> list[dict[str, Any]]:
        last: dict[str, dict[str, Any]] = {}
        for line in read_records(self.path):
            if "request_id" in line:  # later lines win; an earlier line's fields stay unless overwritten
                last[line["request_id"]] = {**last.get(line["request_id"], {}), **line}
        return list(last.values())

    async def states(self) -> list[dict[str, Any]]:
        await self.close()  # the file is replaced after recovery
        return await asyncio.to_thread(self._states)

    def _replace(self, lines: list[dict[str, Any]]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        replace_file(self.path, jsonl(lines))  # never through a link

    async def replace(self, lines: list[dict[str, Any]]) -> None:
        await self.close()
        await asyncio.to_thread(self._replace, lines)
