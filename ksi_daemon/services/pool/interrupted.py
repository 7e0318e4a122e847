"""Responses a restart interrupted, by response id: what `completion:chunks` answers for a response
whose chunk log went with the killed daemon, so a door reading it by id tells a crash from a wrong
id. On one daemon the journal's account stands (`failed`, `daemon_restart`: nothing was stored);
on the pool the request is another daemon's (or this one's, once it takes it over), and its state
is read from the pool until a chunk log of its own is opened. A request this daemon handed over
to another (claimed, or taken over while this one was paused) is read from the pool the same way. Either is shown from the request's
`RequestView`, as completion:status and completion:wait see it, in the shape a kept log is shown."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from pydantic import ValidationError

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.request_status import RequestStatus
from ksi_common.timefmt import parse_ts
from ksi_daemon.services.completion.models import CompletionAsync
from ksi_daemon.services.completion.request_view import RequestView, journal_view, pool_view
from ksi_daemon.services.completion.streams import chunks_answer, shown_request
from ksi_daemon.storage.ports import PoolRequests

RECHECK = 1.0  # seconds a reader asking to wait is held before the pool is read again


class InterruptedResponses:
    """The journal records of the previous run's unfinished requests, and the requests this run
    handed over to another daemon, by response id."""

    def __init__(self, pool: PoolRequests) -> None:
        self.pool = pool
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
        """A `completion:chunks` answer for an interrupted response (no chunks), or None when none
        was interrupted under that id or its stored record answers for it now."""
        lost = self._lost.get(response_id)
        if lost is not None:
            view = journal_view(lost)
            shown = shown_request(view.request_id, response_id, view.conversation_id, view.model)
            return _answer(shown, view)
        line = self._pooled.get(response_id)
        if line is None:
            return None
        pooled = await self._pooled_view(line, response_id)
        if pooled is not None and pooled[1].status is RequestStatus.QUEUED and wait > 0:
            await asyncio.sleep(min(wait, RECHECK))  # not ours yet: no change is signalled here
            pooled = await self._pooled_view(line, response_id)
        return _answer(*pooled) if pooled is not None else None

    async def _pooled_view(self, line: dict[str, Any], response_id: str) -> tuple[dict[str, Any], RequestView] | None:
        """The request as the pool's row shows it, None once done (response:show answers for it)."""
        try:
            found = await self.pool.find(line["request_id"])
        except KsiError:  # the database is away: answered as an id it does not know
            return None
        if found is None:
            return None
        view = pool_view(found)
        if view.status is RequestStatus.DONE:
            return None
        shown = shown_request(view.request_id, response_id, view.conversation_id, view.model or line.get("model"),
                              found.record.get("agent_id"), _request(found.record))
        return shown, view


def _answer(shown: dict[str, Any], view: RequestView) -> dict[str, Any]:
    error = view.error.to_wire() if view.error is not None else None
    return chunks_answer(shown, view.status, _epoch(view.created) or time.time(), _epoch(view.ended),
                         result=view.result, error=error)


def _request(record: dict[str, Any]) -> CompletionAsync | None:
    """The request as the pool keeps it, for what a reader is shown of it (None: not readable)."""
    try:
        return CompletionAsync.model_validate(record["request"]) if "request" in record else None
    except ValidationError:
        return None


def _epoch(ts: str | None) -> float | None:
    try:
        return parse_ts(ts) if ts else None
    except ValueError:
        return None
