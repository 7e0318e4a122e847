"""Submitting a completion and waiting for its result, written once for every door and client.

The one timeout rule: each completion:wait asks the daemon for at most WAIT_SLICE seconds, and a
reply that is not yet the result (the request still queued or running) is waited for again. So a
long answer is never cut short by the wait itself; only a caller's own deadline or a cancel ends it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any, Protocol

from ksi_common.errors import KsiError
from ksi_common.events import COMPLETION_ASYNC, COMPLETION_CHUNK, COMPLETION_RESULT, COMPLETION_STATUS, COMPLETION_WAIT
from ksi_common.oneshot import Connection

WAIT_SLICE = 300.0  # seconds per completion:wait, below every door's idle limit


class Caller(Protocol):
    """Whatever sends one event and awaits its reply: the socket client or the in-process router."""

    async def request(self, event: str, data: dict[str, Any]) -> dict[str, Any]:
        """The reply data of `event`; a failure raises its KsiError."""
        ...


class PushedCaller(Caller, Protocol):
    """A Caller on a connection that also hears pushed events (the socket client)."""

    async def next_push(self) -> dict[str, Any] | None:
        """The next pushed frame, or None once the connection closed."""
        ...

    def push_ready(self) -> dict[str, Any] | None:
        """A frame already pushed, taken without waiting; None when none is there."""
        ...


async def wait_for_result(caller: Caller, request_id: str) -> dict[str, Any]:
    """completion:wait, again while the request is queued or running, until its result data (a
    failed or cancelled request raises its KsiError)."""
    while True:
        reply = await caller.request(COMPLETION_WAIT, {"request_id": request_id, "timeout": WAIT_SLICE})
        if "content" in reply:  # the result data; a status reply carries none
            return reply


async def submit_and_wait(caller: Caller, data: dict[str, Any]) -> dict[str, Any]:
    """completion:async with `data`, then its result data."""
    ack = await caller.request(COMPLETION_ASYNC, data)
    return await wait_for_result(caller, ack["request_id"])


async def follow(caller: PushedCaller, request_id: str, wait: float = WAIT_SLICE,
                 *, once: bool = False) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """(completion:chunk, its data) for each chunk of `request_id` pushed while it runs, then
    (completion:result, the result data) last; the caller subscribed to chunks before submitting,
    so none is missed. A failed or cancelled request raises its KsiError; so does a closed connection.
    With `once`, a wait of `wait` seconds that ends before the result is the caller's own deadline:
    its status reply comes last as (completion:status, the reply) instead of being waited for again."""
    while True:
        waiter = asyncio.ensure_future(
            caller.request(COMPLETION_WAIT, {"request_id": request_id, "timeout": wait}))
        try:
            while True:
                # frames already queued come first: a reply is read after every frame pushed
                # before it, so the chunks of the last burst are taken before the result is given
                if (frame := caller.push_ready()) is None:
                    if waiter.done():
                        break
                    if (frame := await _push_or_reply(caller, waiter)) is None:
                        continue
                if frame.get("event") == COMPLETION_CHUNK and (frame.get("data") or {}).get("request_id") == request_id:
                    yield COMPLETION_CHUNK, frame["data"]
        finally:
            waiter.cancel()  # a consumer gone mid-stream leaves no wait behind; a done waiter is left as it is
        reply = waiter.result()
        if "content" in reply:  # else still queued or running: wait again
            yield COMPLETION_RESULT, reply
            return
        if once:
            yield COMPLETION_STATUS, reply
            return


async def _push_or_reply(caller: PushedCaller, waiter: asyncio.Future[Any]) -> dict[str, Any] | None:
    """The next frame pushed, or None once `waiter` is done first (it fails too when the connection
    closed)."""
    pusher = asyncio.ensure_future(caller.next_push())
    try:
        await asyncio.wait({waiter, pusher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        pusher.cancel()  # a read still waiting takes no frame once cancelled; a done one keeps its frame
    if not pusher.done():
        return None
    if (frame := pusher.result()) is None:  # closed: the waiter fails with it
        await asyncio.wait({waiter})
    return frame


def follow_blocking(connection: Connection, request_id: str, wait: float = WAIT_SLICE,
                    *, once: bool = False) -> Iterator[tuple[str, dict[str, Any]]]:
    """follow on a blocking one-shot connection (the CLI's and the llm plugin's synchronous path)."""
    while True:
        waiting = connection.send(COMPLETION_WAIT, {"request_id": request_id, "timeout": wait})
        while True:
            # pushes kept while an acknowledgement was awaited come first
            frame = connection.pushes.pop(0) if connection.pushes else connection.read_frame()
            data = frame.get("data") or {}
            if frame.get("push"):
                if frame.get("event") == COMPLETION_CHUNK and data.get("request_id") == request_id:
                    yield COMPLETION_CHUNK, data
            elif frame.get("correlation_id") == waiting:
                if "error" in frame:
                    raise KsiError.from_wire(frame["error"])
                break
        if "content" in data:
            yield COMPLETION_RESULT, data
            return
        if once:
            yield COMPLETION_STATUS, data
            return
