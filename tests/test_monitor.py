"""monitor:subscribe / monitor:unsubscribe: pushed events, their lifetime, slow subscribers."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import orjson
import pytest
from pydantic import Field

from ksi_common.client import KsiClient
from ksi_common.errors import KsiError
from ksi_daemon.context import EventContext
from ksi_daemon.daemon import Daemon
from ksi_daemon.events import EventData, Text
from tests.conftest import connected, running_daemon

TIMEOUT = 10.0
PUSH_KEYS = {"push", "subscription_id", "event", "data", "event_id", "context", "timestamp"}


async def subscribe(client: KsiClient, *patterns: str) -> str:
    reply = await client.request("monitor:subscribe", {"patterns": list(patterns)})
    assert reply["patterns"] == list(patterns)
    return reply["subscription_id"]


async def no_push(client: KsiClient, wait: float = 0.1) -> None:
    with pytest.raises(TimeoutError):
        await client.next_push(timeout=wait)


async def health(daemon: Daemon) -> dict[str, Any]:
    async with connected(daemon) as other:
        return await asyncio.wait_for(other.request("system:health"), TIMEOUT)


async def test_subscriber_gets_events_caused_by_another_connection(daemon: Daemon, client: KsiClient) -> None:
    subscription_id = await subscribe(client, "system:*")
    async with connected(daemon) as other:
        reply = await other.send_frame("system:health")
    push = await client.next_push(timeout=TIMEOUT)
    assert push is not None
    assert PUSH_KEYS <= set(push)
    assert push["push"] is True
    assert push["subscription_id"] == subscription_id
    assert push["event"] == "system:health"
    assert push["data"] == {}
    assert push["event_id"].startswith("evt-")
    assert push["context"]["event_id"] == push["event_id"]
    assert push["context"]["correlation_id"] == reply["correlation_id"]
    assert push["context"]["parent_event_id"] is None
    assert "correlation_id" not in push
    assert push["timestamp"].endswith("Z")


async def test_push_carries_the_request_data(daemon: Daemon, client: KsiClient) -> None:
    await subscribe(client, "system:help")
    async with connected(daemon) as other:
        await other.request("system:help", {"event": "system:health"})
        await other.request("system:discover")
    push = await client.next_push(timeout=TIMEOUT)
    assert push is not None
    assert (push["event"], push["data"]) == ("system:help", {"event": "system:health"})
    await no_push(client)


async def test_non_matching_events_are_not_delivered(daemon: Daemon, client: KsiClient) -> None:
    await subscribe(client, "system:discover")
    async with connected(daemon) as other:
        await other.request("system:health")
        await other.request("system:help", {"event": "system:health"})
        await other.request("system:discover")
    push = await client.next_push(timeout=TIMEOUT)
    assert push is not None and push["event"] == "system:discover"
    await no_push(client)


async def test_several_patterns_and_subscriptions(daemon: Daemon, client: KsiClient) -> None:
    first = await subscribe(client, "system:health", "system:discover")
    second = await subscribe(client, "*")
    async with connected(daemon) as other:
        await other.request("system:health")
    pushes = [await client.next_push(timeout=TIMEOUT) for _ in range(2)]
    assert sorted(p["subscription_id"] for p in pushes if p) == sorted([first, second])
    await no_push(client)


async def test_monitor_events_are_not_pushed(daemon: Daemon, client: KsiClient) -> None:
    await subscribe(client, "*")
    async with connected(daemon) as other:
        await other.request("monitor:subscribe", {"patterns": ["agent:*"]})
        await other.request("system:health")
    push = await client.next_push(timeout=TIMEOUT)
    assert push is not None and push["event"] == "system:health"
    await no_push(client)


async def test_unsubscribe_stops_delivery(daemon: Daemon, client: KsiClient) -> None:
    subscription_id = await subscribe(client, "system:*")
    reply = await client.request("monitor:unsubscribe", {"subscription_id": subscription_id})
    assert reply == {"subscription_id": subscription_id, "status": "unsubscribed"}
    async with connected(daemon) as other:
        await other.request("system:health")
    await no_push(client)
    assert (await health(daemon))["subscriptions"] == 0
    # a second unsubscribe of the same id is an error
    with pytest.raises(KsiError) as caught:
        await client.request("monitor:unsubscribe", {"subscription_id": subscription_id})
    assert caught.value.code == "validation_error"


async def test_unknown_subscription_id_is_validation_error(client: KsiClient) -> None:
    reply = await client.send_frame("monitor:unsubscribe", {"subscription_id": "sub-nope"})
    assert reply["error"]["code"] == "validation_error"
    assert "subscription_id" in reply["error"]["details"]["fields"]
    reply = await client.send_frame("monitor:unsubscribe", {})
    assert reply["error"]["code"] == "validation_error"
    assert "subscription_id" in reply["error"]["details"]["fields"]


@pytest.mark.parametrize("patterns", [["sys*tem"], ["*:health"], ["system*"], [""], ["system:health", "a*b"]])
async def test_bad_pattern_is_validation_error(client: KsiClient, patterns: list[str]) -> None:
    reply = await client.send_frame("monitor:subscribe", {"patterns": patterns})
    assert reply["error"]["code"] == "validation_error"
    assert any(field.startswith("patterns") for field in reply["error"]["details"]["fields"])
    assert (await client.request("system:health"))["subscriptions"] == 0


async def test_patterns_must_be_a_list(client: KsiClient) -> None:
    reply = await client.send_frame("monitor:subscribe", {"patterns": {"a": 1}})
    assert reply["error"]["code"] == "validation_error"
    assert "patterns" in reply["error"]["details"]["fields"]


async def test_closing_the_connection_ends_its_subscriptions(daemon: Daemon) -> None:
    async with connected(daemon) as subscriber:
        await subscribe(subscriber, "system:*")
        await subscribe(subscriber, "*")
        assert (await subscriber.request("system:health"))["subscriptions"] == 2
    for _ in range(100):
        if (await health(daemon))["subscriptions"] == 0:
            break
        await asyncio.sleep(0.01)
    assert (await health(daemon))["subscriptions"] == 0
    assert (await health(daemon))["connections"] == 1


class BlobData(EventData):
    blob: Text = Field(description="padding")


class LineSocket:
    """A raw non-blocking socket: unlike a StreamReader it reads nothing until asked."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    @classmethod
    async def open(cls, path: Path) -> LineSocket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, str(path))
        return cls(sock)

    async def send(self, frame: dict[str, Any]) -> None:
        await asyncio.get_running_loop().sock_sendall(self.sock, orjson.dumps(frame) + b"\n")

    async def read(self) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        while b"\n" not in self.buffer:
            chunk = await asyncio.wait_for(loop.sock_recv(self.sock, 1 << 20), TIMEOUT)
            assert chunk, "connection closed"
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return orjson.loads(line)


async def test_slow_subscriber_does_not_stall_the_daemon(short_tmp: Path) -> None:
    async with running_daemon(short_tmp, push_queue_size=5) as daemon:

        async def take_blob(_data: BlobData, _context: EventContext) -> dict[str, Any]:
            return {"ok": True}

        daemon.router.register("test:blob", take_blob, BlobData, "takes a large payload")
        slow = await LineSocket.open(daemon.settings.socket)
        try:
            await slow.send({"event": "monitor:subscribe", "data": {"patterns": ["test:*"]}})
            subscription_id = (await slow.read())["data"]["subscription_id"]
            # From now on the subscriber reads nothing while others cause ~8 MB of pushes to it.
            blob = "b" * 100_000
            async with connected(daemon) as producer:
                for _ in range(80):
                    await asyncio.wait_for(producer.request("test:blob", {"blob": blob}), TIMEOUT)
            subscriber = [conn for conn in daemon.server.connections if conn.paused_by_writer]
            assert len(subscriber) == 1
            assert len(subscriber[0].pending_pushes) <= 5
            assert subscriber[0].lost_pushes > 0
            # the daemon still answers everyone else at once
            for _ in range(20):
                assert (await health(daemon))["status"] == "healthy"

            # Now it reads: what was kept arrives, then the overflow notice.
            overflow = None
            kept = 0
            while overflow is None:
                frame = await slow.read()
                assert frame["push"] is True
                if frame["event"] == "monitor:overflow":
                    overflow = frame
                else:
                    assert frame["event"] == "test:blob"
                    assert frame["subscription_id"] == subscription_id
                    kept += 1
            assert overflow["data"]["lost_events"] > 0
            assert overflow["timestamp"].endswith("Z")
            # pushes still queued when the notice was written follow it; none is lost silently
            while kept + overflow["data"]["lost_events"] < 80:
                frame = await slow.read()
                assert frame["event"] == "test:blob"
                kept += 1
            assert kept + overflow["data"]["lost_events"] == 80

            # the subscription is still alive afterwards
            async with connected(daemon) as producer:
                await producer.request("test:blob", {"blob": "small"})
            frame = await slow.read()
            assert (frame["event"], frame["data"]) == ("test:blob", {"blob": "small"})
        finally:
            slow.sock.close()
