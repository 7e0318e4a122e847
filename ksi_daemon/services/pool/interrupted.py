"""Responses a restart interrupted, by response id: what `completion:chunks` answers for a response
whose chunk log went with the killed daemon, so a door reading it by id tells a crash from a wrong
id. On one daemon the journal's account stands (`failed`, `daemon_restart`: nothing was stored);
on the pool the request is another daemon's (or this one's, once it takes it over), and its state
is read from the pool until a chunk log of its own is opened."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.timefmt import parse_ts
from ksi_daemon.services.pool.elsewhere import RequestsElsewhere
from ksi_daemon.storage.ports import PoolRequest

RECHECK = 1.0  # seconds a reader asking to wait is held before the pool is read again
RESTART_MESSAGE = "the response was interrupted by a daemon restart"


def _epoch(ts: Any) -> float:
    try:
        return parse_ts(ts) if isinstance(ts, str) else time.time()
    except ValueError:
        return time.time()


class InterruptedResponses:
    """The journal records of the previous run's unfinished requests, by response id."""

    def __init__(self, elsewhere: RequestsElsewhere) -> None:
        self.elsewhere = elsewhere
        self._lost: dict[str, dict[str, Any]] = {}  # failed daemon_restart: nobody runs them again
        self._pooled: dict[str, dict[str, Any]] = {}  # the pool holds them: a live daemon runs them

    def add(self, record: dict[str, Any], pooled: bool) -> None:
        response_id = record.get("response_id")
        if not response_id:
            return
        if pooled:
            self._pooled[response_id] = record
        elif record.get("code") == ErrorCode.DAEMON_RESTART:
            self._lost[response_id] = record

    async def view(self, response_id: str, wait: float) -> dict[str, Any] | None:
        """A `completion:chunks` view of an interrupted response (no chunks), or None when none was
        interrupted under that id or its stored record answers for it now."""
        lost = self._lost.get(response_id)
        if lost is not None:
            error = {"code": ErrorCode.DAEMON_RESTART, "message": RESTART_MESSAGE}
            return _view(lost, response_id, str(lost.get("model") or ""), "failed", error)
        pooled = self._pooled.get(response_id)
        if pooled is None:
            return None
        found = await self._find(pooled["request_id"])
        if found is None or found.indexed or found.status == "done":
            return None  # stored: response:show answers for it
        if found.status == "queued" and wait > 0:
            await asyncio.sleep(min(wait, RECHECK))  # not ours yet: no change is signalled here
        error = None
        if found.status == "failed":
            code = found.code or ErrorCode.INTERNAL_ERROR
            error = {"code": code, "message": f"the request ended failed ({code}) on a daemon of the pool"}
        return _view(pooled, response_id, str(found.record.get("model") or pooled.get("model") or ""),
                     found.status, error)

    async def _find(self, request_id: str) -> PoolRequest | None:
        try:
            return await self.elsewhere.requests.find(request_id)
        except KsiError:  # the database is away: answered as an id it does not know
            return None


def _view(record: dict[str, Any], response_id: str, model: str, status: str,
          error: dict[str, Any] | None) -> dict[str, Any]:
    created = _epoch(record.get("queued_at") or record.get("ts"))
    ended = _epoch(record.get("ts")) if status in ("failed", "cancelled") else None
    return {
        "request_id": record["request_id"], "response_id": response_id,
        "conversation_id": record.get("conversation_id"),
        "model": model, "agent_id": None, "request": {}, "status": status, "created": created, "ended": ended,
        "first": 0, "chunks": [], "total_chunks": 0, "result": None, "error": error,
    }
