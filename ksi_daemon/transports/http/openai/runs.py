"""Following one completion request to its outcome through events: waiting for the result, or
streaming its chunks as they are pushed. Shared by the Responses and Chat Completions routes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any

from ksi_common.errors import KsiError
from ksi_common.events import COMPLETION_ASYNC, COMPLETION_CANCEL, COMPLETION_CHUNK, MONITOR_SUBSCRIBE
from ksi_common.submitting import follow, submit_and_wait
from ksi_daemon.transports.http.door import (
    HttpOrigin,
    OriginCaller,
    RequestHandler,
    RouterCaller,
    call,
    streamed_failure,
)


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
    """One streamed request, followed as every client follows one (ksi_common.submitting.follow):
    subscribed to chunks before it is submitted, so none is missed; its outcome is completion:wait's."""

    def __init__(self, handle_request: RequestHandler, background: set[asyncio.Task[Any]]) -> None:
        self.handle_request = handle_request
        self.background = background  # keeps the cancel task alive once this stream is gone
        # chunks only: a client slower than its answer loses the chunks past the limit, never the outcome
        self.origin = HttpOrigin(limit=100_000)
        self.caller = OriginCaller(handle_request, self.origin)
        self.ack: dict[str, Any] = {}
        self.finished = False
        self._cancelled = False
        self._followed: AsyncGenerator[tuple[str, dict[str, Any]], None] | None = None

    async def start(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Submit; the ack, or the KsiError that refused the request (nothing is streamed then)."""
        await self.caller.request(MONITOR_SUBSCRIBE, {"patterns": [COMPLETION_CHUNK]})
        try:
            self.ack = await self.caller.request(COMPLETION_ASYNC, {**payload, "stream": True})
        except BaseException:
            self.origin.close()
            raise
        return self.ack

    async def events(self) -> AsyncIterator[Chunk | Done | Failed]:
        request_id = self.ack["request_id"]
        self._followed = follow(self.caller, request_id)
        try:
            async for event, data in self._followed:
                if event == COMPLETION_CHUNK:
                    call, reasoning = data.get("tool_call"), data.get("reasoning")
                    yield Chunk(str(data.get("text") or ""), call if isinstance(call, dict) else None,
                                reasoning if isinstance(reasoning, dict) else None)
                else:
                    self.finished = True
                    yield Done(data)
        except KsiError as error:
            self.finished = True
            yield Failed(streamed_failure(error, request_id))
        self.origin.close()

    def abandon(self) -> None:
        """The client went away: stop following (no wait is left behind), cancel the request unless it
        ended (its exchange is then written whole or not at all), and end the subscription.
        Synchronous, as it runs while being cancelled."""
        self.origin.close()
        if self.finished or not self.ack or self._cancelled:
            return
        self._cancelled = True
        if self._followed is not None:  # left at a chunk: closing it cancels its completion:wait
            self._spawn(self._followed.aclose())
        self._spawn(call(self.handle_request, COMPLETION_CANCEL, {"request_id": self.ack["request_id"]}))

    def _spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self.background.add(task)
        task.add_done_callback(self._settled)

    def _settled(self, task: asyncio.Task[Any]) -> None:
        self.background.discard(task)
        if not task.cancelled():
            task.exception()  # a request that ended meanwhile cannot be cancelled: nothing to report
