"""Following one completion request to its outcome through events: waiting for the result, or
streaming its chunks as they are pushed. Shared by the Responses and Chat Completions routes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.events import (
    COMPLETION_ASYNC,
    COMPLETION_CANCEL,
    COMPLETION_CANCELLED,
    COMPLETION_CHUNK,
    COMPLETION_ERROR,
    COMPLETION_RESULT,
    MONITOR_SUBSCRIBE,
)
from ksi_common.submitting import submit_and_wait
from ksi_daemon.transports.http.door import HttpOrigin, RequestHandler, RouterCaller, call

OUTCOMES = (COMPLETION_RESULT, COMPLETION_ERROR, COMPLETION_CANCELLED)


async def complete(handle_request: RequestHandler, payload: dict[str, Any]) -> dict[str, Any]:
    """The result data of a completion:async with `payload` (a failure raises its KsiError)."""
    return await submit_and_wait(RouterCaller(handle_request), payload)


@dataclass(slots=True)
class Chunk:
    text: str
    tool_call: dict[str, Any] | None = None  # {"index", "call_id", "name", "arguments": a delta}
    reasoning: dict[str, str] | None = None  # {"text"} of a thinking block, its {"signature"}, or {"redacted"}


@dataclass(slots=True)
class Done:
    result: dict[str, Any]


@dataclass(slots=True)
class Failed:
    error: KsiError


class CompletionStream:
    """One streamed request: subscribed to its events before it is submitted, so no chunk is missed."""

    def __init__(self, handle_request: RequestHandler, background: set[asyncio.Task[Any]]) -> None:
        self.handle_request = handle_request
        self.background = background  # keeps the cancel task alive once this stream is gone
        self.origin = HttpOrigin(limit=100_000)
        self.ack: dict[str, Any] = {}
        self.finished = False
        self._cancelled = False

    async def start(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Submit; the ack, or the KsiError that refused the request (nothing is streamed then)."""
        await call(self.handle_request, MONITOR_SUBSCRIBE, {"patterns": [COMPLETION_CHUNK, *OUTCOMES]},
                   self.origin)
        try:
            self.ack = await call(self.handle_request, COMPLETION_ASYNC, {**payload, "stream": True}, self.origin)
        except BaseException:
            self.origin.close()
            raise
        return self.ack

    async def events(self) -> AsyncIterator[Chunk | Done | Failed]:
        request_id = self.ack["request_id"]
        while True:
            frame = await self.origin.queue.get()
            data = frame.get("data") or {}
            if data.get("request_id") != request_id:
                continue  # a subscription sees every request's events; this stream follows one
            event = frame["event"]
            if event == COMPLETION_CHUNK:
                call, reasoning = data.get("tool_call"), data.get("reasoning")
                yield Chunk(str(data.get("text") or ""), call if isinstance(call, dict) else None,
                            reasoning if isinstance(reasoning, dict) else None)
                continue
            self.finished = True
            self.origin.close()
            if event == COMPLETION_RESULT:
                yield Done(data)
            else:
                yield Failed(KsiError(data.get("code") or ErrorCode.INTERNAL_ERROR, data.get("message") or "",
                                      **(data.get("details") or {})))
            return

    def abandon(self) -> None:
        """The client went away: cancel the request unless it ended (its exchange is then written whole
        or not at all), and end the subscription. Synchronous, as it runs while being cancelled."""
        self.origin.close()
        if self.finished or not self.ack or self._cancelled:
            return
        self._cancelled = True
        task = asyncio.get_running_loop().create_task(
            call(self.handle_request, COMPLETION_CANCEL, {"request_id": self.ack["request_id"]}))
        self.background.add(task)
        task.add_done_callback(self._settled)

    def _settled(self, task: asyncio.Task[Any]) -> None:
        self.background.discard(task)
        if not task.cancelled():
            task.exception()  # a request that ended meanwhile cannot be cancelled: nothing to report
