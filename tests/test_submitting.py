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
    MONITOR_SUBSCRIBE,
)
from ksi_common.oneshot import Connection
from ksi_common.submitting import follow, follow_blocking, submit_and_wait, wait_for_result
from ksi_daemon.transports.http.door import RouterCaller
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
    assert followed[-1][1]["content"].startswith("".join(chunk["text"] for chunk in chunks))
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
