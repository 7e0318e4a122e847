"""submit_and_wait, wait_for_result and follow, the one way a door or client submits a completion
and waits, over the real socket client and the router's caller of the HTTP doors."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from ksi_common.client import KsiClient
from ksi_common.errors import KsiError
from ksi_common.events import (
    COMPLETION_ASYNC,
    COMPLETION_CHUNK,
    COMPLETION_RESULT,
    COMPLETION_STATUS,
    COMPLETION_WAIT,
    MONITOR_SUBSCRIBE,
)
from ksi_common.oneshot import Connection
from ksi_common.submitting import follow, follow_blocking, submit_and_wait, wait_for_result
from ksi_daemon.transports.http.door import HttpOrigin, OriginCaller, RouterCaller
from tests.conftest import running_daemon, stub_settings
from tests.stub_openai import Reply, StubOpenAI


async def test_submit_and_wait_returns_the_result_over_the_socket_and_the_router(short_tmp: Path) -> None:
    async with running_daemon(short_tmp) as daemon, KsiClient(daemon.settings.socket) as client:
        by_socket = await submit_and_wait(client, {"prompt": "over the socket", "model": "echo/a"})
        by_router = await submit_and_wait(RouterCaller(daemon._handle_request),
                                          {"prompt": "in the daemon", "model": "echo/a"})
    assert by_socket["content"].startswith("You said: over the socket")
    assert by_router["content"].startswith("You said: in the daemon")


async def test_follow_yields_the_chunks_then_the_result(short_tmp: Path, stub: StubOpenAI) -> None:
    gate = asyncio.Event()  # the answer holds its rest after its first chunk until this is set
    stub.enqueue(Reply(text="one two three", gate=gate), "not followed")
    followed: list[tuple[str, dict[str, Any]]] = []
    async with running_daemon(short_tmp, **stub_settings(stub)) as daemon, \
            KsiClient(daemon.settings.socket) as client:
        await client.request(MONITOR_SUBSCRIBE, {"patterns": [COMPLETION_CHUNK]})
        ack = await client.request(COMPLETION_ASYNC, {"prompt": "followed", "stream": True})
        async for event, data in follow(client, ack["request_id"]):
            followed.append((event, data))
            gate.set()  # the first chunk came while the answer was held: the rest may follow
        other = await submit_and_wait(client, {"prompt": "another", "stream": True})
    events = [event for event, _ in followed]
    assert events[0] == COMPLETION_CHUNK and events[-1] == COMPLETION_RESULT
    assert events.count(COMPLETION_RESULT) == 1
    chunks = [data for event, data in followed if event == COMPLETION_CHUNK]
    assert all(chunk["request_id"] == ack["request_id"] for chunk in chunks)
    # every chunk, those that came in one burst with the result included
    assert "".join(chunk["text"] for chunk in chunks) == followed[-1][1]["content"]
    assert followed[-1][1]["content"] == "one two three" and other["content"] == "not followed"


async def test_a_wait_that_fails_raises_its_error(short_tmp: Path) -> None:
    async with running_daemon(short_tmp) as daemon, KsiClient(daemon.settings.socket) as client:
        with pytest.raises(KsiError) as raised:
            await wait_for_result(client, "req-never-made")
        with pytest.raises(KsiError) as refused:
            await submit_and_wait(client, {"prompt": "hi", "model": "nowhere/none"})
    assert raised.value.code == "request_not_found"
    assert refused.value.code == "model_not_found"


async def test_follow_blocking_gives_chunks_then_the_status_when_its_one_wait_ends_first(
        short_tmp: Path, stub: StubOpenAI) -> None:
    gate = asyncio.Event()  # the answer holds its rest after its first chunk until this is set
    stub.enqueue(Reply(text="one two three", gate=gate))
    async with running_daemon(short_tmp, **stub_settings(stub)) as daemon:
        def held() -> tuple[str, list[tuple[str, dict[str, Any]]]]:
            with Connection(daemon.settings.socket, timeout=30) as connection:
                connection.request(MONITOR_SUBSCRIBE, {"patterns": [COMPLETION_CHUNK]})
                request_id = connection.request(COMPLETION_ASYNC, {"prompt": "held", "stream": True})["request_id"]
                return request_id, list(follow_blocking(connection, request_id, 0.5, once=True))

        request_id, followed = await asyncio.to_thread(held)
        gate.set()
        async with KsiClient(daemon.settings.socket) as client:
            result = await wait_for_result(client, request_id)
    assert [event for event, _ in followed] == [COMPLETION_CHUNK, COMPLETION_STATUS]
    assert followed[-1][1]["status"] in ("queued", "running") and "content" not in followed[-1][1]
    assert result["content"] == "one two three"


def waits_for(request_id: str) -> list[asyncio.Task[Any]]:
    """The tasks of this loop still waiting, through the HTTP doors' caller, for `request_id`."""
    waiting = []
    for task in asyncio.all_tasks():
        frame = getattr(task.get_coro(), "cr_frame", None)
        if frame is None or frame.f_code.co_qualname != "OriginCaller.request":
            continue
        if frame.f_locals.get("event") == COMPLETION_WAIT and frame.f_locals["data"]["request_id"] == request_id:
            waiting.append(task)
    return waiting


async def test_follow_in_the_daemon_gives_every_chunk_and_one_left_early_leaves_no_wait(
        short_tmp: Path, stub: StubOpenAI) -> None:
    gate = asyncio.Event()
    stub.enqueue(Reply(text="held after one", gate=gate), Reply(text=" ".join(f"w{i}" for i in range(60))))
    async with running_daemon(short_tmp, **stub_settings(stub)) as daemon:
        caller = OriginCaller(daemon._handle_request, HttpOrigin(limit=1000))  # as the HTTP doors follow
        await caller.request(MONITOR_SUBSCRIBE, {"patterns": [COMPLETION_CHUNK]})
        held = (await caller.request(COMPLETION_ASYNC, {"prompt": "held", "stream": True}))["request_id"]
        followed = follow(caller, held)
        assert (await anext(followed))[0] == COMPLETION_CHUNK
        assert len(waits_for(held)) == 1
        await followed.aclose()  # its consumer went away while the request runs on
        for _ in range(100):  # the cancelled wait ends within a few turns of the loop
            if not waits_for(held):
                break
            await asyncio.sleep(0)
        assert waits_for(held) == []
        assert (await caller.request(COMPLETION_STATUS, {"request_id": held}))["status"] == "running"
        gate.set()
        ack = await caller.request(COMPLETION_ASYNC, {"prompt": "many words", "stream": True})
        streamed = [(event, data) async for event, data in follow(caller, ack["request_id"])]
        caller.origin.close()
    texts = [data["text"] for event, data in streamed if event == COMPLETION_CHUNK]
    assert len(texts) > 1 and "".join(texts) == streamed[-1][1]["content"]
    assert streamed[-1][0] == COMPLETION_RESULT and waits_for(ack["request_id"]) == []


async def test_chunks_pushed_in_one_burst_with_the_result_all_come_before_it() -> None:
    """A daemon that ended the request while its last chunks still sit unread in the queue: the
    wait's reply is ready as soon as it is asked for, yet every chunk comes first."""
    origin = HttpOrigin(limit=100)
    pieces = ["one ", "two ", "three"]
    for index, text in enumerate(pieces):
        origin.push({"event": COMPLETION_CHUNK, "push": True, "data": {"request_id": "req-1", "index": index,
                                                                        "text": text}})
    origin.push({"event": COMPLETION_CHUNK, "push": True, "data": {"request_id": "req-other", "text": "not mine"}})

    async def ended(event: str, data: dict[str, Any], _context: Any) -> dict[str, Any]:
        assert event == COMPLETION_WAIT and data["request_id"] == "req-1"
        return {"request_id": "req-1", "content": "".join(pieces)}

    followed = [item async for item in follow(OriginCaller(ended, origin), "req-1")]
    assert [event for event, _ in followed] == [COMPLETION_CHUNK] * 3 + [COMPLETION_RESULT]
    assert [data["text"] for _, data in followed[:3]] == pieces
