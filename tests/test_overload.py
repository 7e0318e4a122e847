"""Overload: a bounded global queue answers `overloaded` with a retry hint, and a connection never
has more requests running than its in-flight limit, however many it pipelines."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest

from ksi_common.errors import KsiError
from ksi_daemon.context import EventContext
from ksi_daemon.events import NoData
from tests.conftest import connected, running_daemon, stub_settings

TIMEOUT = 20.0


async def test_full_queue_answers_overloaded_with_a_retry_hint(short_tmp: Path, stub: Any) -> None:
    stub.hold = 0.4  # every answer takes a while, so the queue fills
    async with running_daemon(short_tmp, **stub_settings(stub, max_queued=3, max_concurrency=1)) as daemon, \
            connected(daemon) as client:
        acks = [await client.request("completion:async", {"prompt": f"p{i}", "conversation_id": f"c{i}",
                                                          "create": True}) for i in range(3)]
        frame = await client.send_frame("completion:async", {"prompt": "one too many",
                                                             "conversation_id": "extra", "create": True})
        error = frame["error"]
        assert error["code"] == "overloaded"
        assert error["details"]["retry_after"] > 0
        assert error["details"]["queued"] == 3
        health = (await client.request("system:health"))["completions"]
        assert health["queued"] + health["running"] == 3  # refused, not queued
        # the refused request left nothing behind: its conversation was never created
        assert not (daemon.layout.meta_file("extra")).exists()
        assert not (daemon.layout.index_file("extra")).exists()
        missing = await client.send_frame("completion:async", {"prompt": "x", "conversation_id": "extra"})
        assert missing["error"]["code"] in ("conversation_not_found", "overloaded")
        # the accepted ones all finish, and then there is room again
        for ack in acks:
            result = await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": TIMEOUT})
            assert result["content"].startswith("stub answer to: p")
        stub.hold = 0
        ack = await client.request("completion:async", {"prompt": "again", "conversation_id": "extra", "create": True})
        result = await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": TIMEOUT})
        assert result["content"] == "stub answer to: again"


async def test_overload_counts_requests_of_every_conversation(short_tmp: Path, stub: Any) -> None:
    stub.hold = 0.3
    async with running_daemon(short_tmp, **stub_settings(stub, max_queued=4)) as daemon, \
            connected(daemon) as client:
        # four requests in one conversation fill the queue just as well as four conversations
        first = await client.request("completion:async", {"prompt": "p0", "conversation_id": "one", "create": True})
        for i in range(1, 4):
            await client.request("completion:async", {"prompt": f"p{i}", "conversation_id": "one"})
        with pytest.raises(KsiError) as caught:
            await client.request("completion:async", {"prompt": "p4", "conversation_id": "one"})
        assert caught.value.code == "overloaded"
        await client.request("completion:wait", {"request_id": first["request_id"], "timeout": TIMEOUT})


async def test_cancelled_and_finished_requests_give_their_place_in_the_queue_back(short_tmp: Path, stub: Any) -> None:
    stub.hold = 0.3
    async with running_daemon(short_tmp, **stub_settings(stub, max_queued=3, max_concurrency=1)) as daemon, \
            connected(daemon) as client:
        acks = [await client.request("completion:async", {"prompt": f"p{i}", "conversation_id": f"c{i}",
                                                          "create": True}) for i in range(2)]
        # two more in one conversation: the second waits behind the first in that conversation's queue
        acks += [await client.request("completion:async", {"prompt": "q", "conversation_id": "c0"})]
        with pytest.raises(KsiError) as caught:
            await client.request("completion:async", {"prompt": "full", "conversation_id": "c1"})
        assert caught.value.code == "overloaded"
        # a queued request cancelled (the one behind c0's first) and a running one cancelled
        for ack in (acks[2], acks[0]):
            assert (await client.request("completion:cancel", {"request_id": ack["request_id"]}))["cancelled"]
        health = (await client.request("system:health"))["completions"]
        assert health["queued"] + health["running"] == 1
        more = [await client.request("completion:async", {"prompt": f"m{i}", "conversation_id": "c1"}) for i in range(2)]
        with pytest.raises(KsiError) as caught:
            await client.request("completion:async", {"prompt": "full again", "conversation_id": "c1"})
        assert caught.value.code == "overloaded"
        for ack in [acks[1], *more]:
            await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": TIMEOUT})
        health = (await client.request("system:health"))["completions"]
        assert health["queued"] == 0 and health["running"] == 0
        # and the conversation whose requests were cancelled takes new ones in order
        ack = await client.request("completion:async", {"prompt": "after", "conversation_id": "c0"})
        result = await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": TIMEOUT})
        assert result["content"] == "stub answer to: after"


class Concurrency:
    """A slow request handler that records how many of its calls run at once, per connection."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.running: dict[int, int] = {}
        self.peak: dict[int, int] = {}
        self.calls = 0

    async def handle(self, _data: NoData, context: EventContext) -> dict[str, Any]:
        key = id(context.origin)
        self.running[key] = self.running.get(key, 0) + 1
        self.peak[key] = max(self.peak.get(key, 0), self.running[key])
        self.calls += 1
        try:
            await asyncio.sleep(self.delay)
        finally:
            self.running[key] -= 1
        return {"ok": True}


async def _pipeline(socket_path: Path, count: int, event: str = "test:slow") -> list[dict[str, Any]]:
    """Write `count` requests in one go, then read every reply."""
    reader, writer = await asyncio.open_unix_connection(str(socket_path))
    payload = b"".join(orjson.dumps({"event": event, "data": {}, "correlation_id": f"p-{i}"}) + b"\n"
                       for i in range(count))
    writer.write(payload)
    await writer.drain()
    replies = []
    try:
        for _ in range(count):
            line = await asyncio.wait_for(reader.readline(), TIMEOUT)
            replies.append(orjson.loads(line))
    finally:
        writer.close()
    return replies


async def test_pipelined_requests_beyond_the_inflight_limit_all_get_replies(short_tmp: Path) -> None:
    async with running_daemon(short_tmp, max_inflight_per_connection=4) as daemon:
        probe = Concurrency(delay=0.05)
        unregister = daemon.router.register("test:slow", probe.handle, NoData, "slow test handler")
        try:
            replies = await _pipeline(daemon.settings.socket, 40)
        finally:
            unregister()
    assert sorted(r["correlation_id"] for r in replies) == sorted(f"p-{i}" for i in range(40))
    assert all(r["data"] == {"ok": True} for r in replies)
    assert probe.calls == 40
    assert list(probe.peak.values()) == [4]  # the limit was reached and never passed


async def test_inflight_limit_is_per_connection(short_tmp: Path) -> None:
    async with running_daemon(short_tmp, max_inflight_per_connection=3) as daemon:
        probe = Concurrency(delay=0.05)
        unregister = daemon.router.register("test:slow", probe.handle, NoData, "slow test handler")
        try:
            results = await asyncio.gather(*(_pipeline(daemon.settings.socket, 12) for _ in range(4)))
            async with connected(daemon) as client:  # the daemon is still answering others
                assert (await client.request("system:health"))["status"] == "healthy"
        finally:
            unregister()
    assert all(len(replies) == 12 and all("data" in r for r in replies) for replies in results)
    assert len(probe.peak) == 4 and max(probe.peak.values()) == 3


async def test_a_line_over_the_limit_behind_paused_requests_is_still_refused(short_tmp: Path) -> None:
    # with reading paused at the in-flight limit, complete lines wait in the buffer: they must not
    # be taken for one over-long line, and a real over-long line is still refused
    async with running_daemon(short_tmp, max_inflight_per_connection=2, line_limit=4096) as daemon:
        probe = Concurrency(delay=0.005)
        unregister = daemon.router.register("test:slow", probe.handle, NoData, "slow test handler")
        try:
            replies = await _pipeline(daemon.settings.socket, 200)  # ~12 KB of small lines
            assert len(replies) == 200 and all("data" in r for r in replies)
            reader, writer = await asyncio.open_unix_connection(str(daemon.settings.socket))
            writer.write(b'{"event": "test:slow"}\n' * 3 + b'{"event": "' + b"x" * 5000 + b'"}\n')
            await writer.drain()
            lines = []
            while raw := await asyncio.wait_for(reader.readline(), TIMEOUT):  # until the daemon closes
                lines.append(orjson.loads(raw))
            writer.close()
            async with connected(daemon) as client:
                assert (await client.request("system:health"))["status"] == "healthy"
        finally:
            unregister()
    codes = [line.get("error", {}).get("code") for line in lines]
    assert "payload_too_large" in codes
