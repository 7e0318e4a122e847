"""The answers of background requests, kept as they arrive: a door reads a request's chunks from
any position (again after its client lost the connection) while it runs and for some minutes
after it ended, whoever was listening when they were produced. Bounded: an ended log goes after
`KEPT_AFTER_END` seconds, or earlier, oldest first, when the ended logs hold too much text or
too many are kept.

A retried attempt starts the log again: the chunks of the attempt that failed are dropped (a
reader never sees them after the retry began), and the retry's chunks are numbered after them, so
a client that read some keeps seeing increasing numbers. An ended log keeps what a resumed stream
shows (its chunks, the request as it is shown, its outcome), not the request's state."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.limits import MAX_TIMEOUT
from ksi_common.request_status import FINISHED, RequestStatus
from ksi_daemon.events import EventData, SafeId
from ksi_daemon.services.completion.models import CompletionAsync
from ksi_daemon.services.completion.requests import RequestState

KEPT_AFTER_END = 600.0  # seconds an ended request's chunks stay readable
MAX_LOGS = 1000  # logs kept at once; the oldest ended ones go first
MAX_ENDED_CHARS = 32 * 1024 * 1024  # text the ended logs may hold together
# the request's options a reader is shown (what a Responses object reports back); others, such as
# headers, stay with the request: anyone holding the response id may read its log
SHOWN_OPTIONS = frozenset({"top_p", "presence_penalty", "frequency_penalty", "user", "reasoning_effort",
                           "response_format", "safety_identifier", "prompt_cache_key"})


class CompletionChunks(EventData):
    response_id: SafeId = Field(description="the response of a request submitted with background: true")
    after: int = Field(default=-1, ge=-1, description="only the chunks after this index (-1: all of them)")
    wait: float = Field(default=0.0, ge=0, le=MAX_TIMEOUT,
                        description="seconds to wait for a chunk after `after` or the end, when there is none yet")


@dataclass(eq=False)
class ChunkLog:
    """One background request: what a reader is shown of it, its state while it runs (for its
    status), its outcome once ended, and its current attempt's non-empty chunks in order."""

    shown: dict[str, Any]  # the request's ids and the request as a reader sees it
    state: RequestState | None  # None once ended: only the outcome below is kept
    created: float  # wall clock, seconds: what a door shows as the creation time
    chunks: list[str] = field(default_factory=list)
    first: int = 0  # the number of chunks[0]: the chunks of attempts that failed come before it
    chars: int = 0
    status: RequestStatus = RequestStatus.QUEUED
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    ended_at: float | None = None  # monotonic
    ended_wall: float | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    dropped: bool = False  # its conversation was deleted
    moved: bool = False  # handed over: another daemon of the pool runs it and keeps its log

    @property
    def total(self) -> int:
        return self.first + len(self.chunks)

    def touch(self) -> None:
        """Wake the readers waiting for more; later readers wait on a fresh event."""
        self.changed.set()
        self.changed = asyncio.Event()


class ChunkLogs:
    """The chunk logs of background requests, by response id."""

    def __init__(self, clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic,
                 kept_after_end: float = KEPT_AFTER_END, max_logs: int = MAX_LOGS,
                 max_ended_chars: int = MAX_ENDED_CHARS) -> None:
        self.clock = clock
        self.monotonic = monotonic
        self.kept_after_end = kept_after_end
        self.max_logs = max_logs
        self.max_ended_chars = max_ended_chars
        self._logs: OrderedDict[str, ChunkLog] = OrderedDict()  # response id -> log, oldest first
        self._by_request: dict[str, ChunkLog] = {}
        self._ended_chars = 0

    def __len__(self) -> int:
        return len(self._logs)

    def open(self, state: RequestState) -> None:
        """Start keeping the chunks of `state` (a request that has its response id)."""
        assert state.response_id is not None
        self._prune()
        shown = shown_request(state.request_id, state.response_id, state.conversation_id, state.model,
                              state.agent_id, state.request)
        log = ChunkLog(shown, state, created=self.clock())
        self._logs[state.response_id] = log
        self._by_request[state.request_id] = log

    def add(self, request_id: str, text: str) -> None:
        log = self._by_request.get(request_id)
        if log is None or not text:  # an empty chunk shows nothing: it is not an event of the stream
            return
        log.chunks.append(text)
        log.chars += len(text)
        log.touch()

    def attempt(self, request_id: str) -> None:
        """A new attempt of the request begins: the chunks of the one before it (which failed) go."""
        log = self._by_request.get(request_id)
        if log is None or not log.chunks:
            return
        log.first, log.chunks, log.chars = log.total, [], 0
        log.touch()

    def ended(self, state: RequestState) -> None:
        log = self._by_request.pop(state.request_id, None)
        if log is None:
            return
        log.status, log.result = state.status, state.result
        log.error = state.error.to_wire() if state.error is not None else None
        log.state = None  # the request's state (its request, context, images) goes with the request
        log.ended_at = self.monotonic()
        log.ended_wall = self.clock()
        self._ended_chars += log.chars
        log.touch()
        self._prune()

    def handed_over(self, request_id: str) -> None:
        """Another daemon of the pool runs the request now: its log here goes (it would never end),
        and a reader waiting on it is woken to ask the pool."""
        log = self._by_request.pop(request_id, None)
        if log is None:
            return
        self._logs.pop(log.shown["response_id"], None)
        log.state, log.moved = None, True
        log.touch()

    def drop_conversation(self, conversation_id: str) -> None:
        """Forget every log of a conversation being deleted: its answers are not served by id again.
        A reader waiting on one is woken and finds it gone."""
        for response_id, log in list(self._logs.items()):
            if log.shown["conversation_id"] != conversation_id:
                continue
            del self._logs[response_id]
            self._by_request.pop(log.shown["request_id"], None)
            if log.ended_at is not None:
                self._ended_chars -= log.chars
            log.dropped = True
            log.touch()

    def _prune(self) -> None:
        """Ended logs past their time go; then the oldest ended ones while over the bounds."""
        now = self.monotonic()
        for response_id, log in list(self._logs.items()):
            if log.ended_at is None:
                continue
            over = len(self._logs) >= self.max_logs or self._ended_chars > self.max_ended_chars
            if now - log.ended_at < self.kept_after_end and not over:
                continue
            del self._logs[response_id]
            self._ended_chars -= log.chars

    async def read(self, data: CompletionChunks) -> dict[str, Any]:
        """The chunks after `data.after`, the request's status and, once it ended, its outcome."""
        self._prune()
        log = self._logs.get(data.response_id)
        if log is None:
            raise KsiError(ErrorCode.RESPONSE_NOT_FOUND,
                           f"no background response {data.response_id} is running or recently ended",
                           response_id=data.response_id)
        if data.wait > 0 and log.total <= data.after + 1 and log.ended_at is None:
            changed = log.changed
            try:
                async with asyncio.timeout(data.wait):
                    await changed.wait()
            except TimeoutError:
                pass
            if log.dropped:
                raise KsiError(ErrorCode.RESPONSE_NOT_FOUND, f"response {data.response_id} was deleted with its "
                               "conversation", response_id=data.response_id)
            if log.moved:  # the pool answers for it (completion:chunks' caller asks it on this code)
                raise KsiError(ErrorCode.RESPONSE_NOT_FOUND, f"response {data.response_id} runs on another daemon "
                               "of the pool", response_id=data.response_id)
        return self._view(log, data.after)

    @staticmethod
    def _view(log: ChunkLog, after: int) -> dict[str, Any]:
        first = max(after + 1, log.first)
        state = log.state
        status = state.status if state is not None else log.status
        result, error = None, None
        if status in FINISHED:
            result = state.result if state is not None else log.result
            wired = state.error.to_wire() if state is not None and state.error is not None else None
            error = wired if state is not None else log.error
        return chunks_answer(log.shown, status, log.created, log.ended_wall, first=first,
                             chunks=log.chunks[first - log.first:], total=log.total, result=result, error=error)


def chunks_answer(shown: dict[str, Any], status: RequestStatus, created: float, ended: float | None, *,
                  first: int = 0, chunks: list[str] | None = None, total: int = 0,
                  result: dict[str, Any] | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
    """completion:chunks's answer, for a request whose log is kept here or for one a restart
    interrupted (no chunks): `shown` (see `shown_request`), its status and times (wall clock,
    seconds), and its result or error (wire form) once it ended."""
    return {**shown, "status": status.value, "created": created, "ended": ended, "first": first,
            "chunks": chunks or [], "total_chunks": total, "result": result, "error": error}


def shown_request(request_id: str, response_id: str | None, conversation_id: str | None, model: str | None,
                  agent_id: str | None = None, request: CompletionAsync | None = None) -> dict[str, Any]:
    """What a reader is shown of a request besides its status, fixed from its admission on; the
    request's fields empty when its source did not keep them (a journal line)."""
    shown_fields: dict[str, Any] = {"temperature": None, "max_tokens": None, "instructions": None,
                                    "metadata": {}, "options": {}}
    if request is not None:
        shown_fields = {"temperature": request.temperature, "max_tokens": request.max_tokens,
                        "instructions": request.instructions, "metadata": dict(request.metadata),
                        "options": {k: v for k, v in request.options.items() if k in SHOWN_OPTIONS}}
    return {"request_id": request_id, "response_id": response_id, "conversation_id": conversation_id,
            "model": model, "agent_id": agent_id, "request": shown_fields}
