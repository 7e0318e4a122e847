"""Streaming: completion:chunk pushes arrive in order, join to the final content, one exchange indexed."""

from __future__ import annotations

from typing import Any

from ksi_common.client import KsiClient
from ksi_common.records import read_index, read_response
from ksi_daemon.daemon import Daemon
from tests.conftest import connected

PROMPT = "one two three four five six"


async def collect(watcher: KsiClient, request_id: str, timeout: float = 30.0) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Chunk pushes of `request_id` until its completion:result push arrives."""
    chunks: list[dict[str, Any]] = []
    while True:
        frame = await watcher.next_push(timeout)
        assert frame is not None, "connection closed"
        data = frame["data"]
        if data.get("request_id") != request_id:
            continue
        if frame["event"] == "completion:chunk":
            chunks.append(data)
        elif frame["event"] == "completion:result":
            return chunks, data
        else:
            raise AssertionError(f"unexpected {frame['event']}: {data}")


async def stream_one(daemon: Daemon, event: str, data: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    async with connected(daemon) as watcher, connected(daemon) as client:
        await watcher.request("monitor:subscribe", {"patterns": ["completion:chunk", "completion:result",
                                                                 "completion:error"]})
        ack = await client.request(event, data)
        chunks, pushed = await collect(watcher, ack["request_id"])
        result = await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 30})
    return chunks, pushed, result


def check_stream(daemon: Daemon, chunks: list[dict[str, Any]], pushed: dict[str, Any], result: dict[str, Any]) -> None:
    assert len(chunks) > 1, "the answer came in one piece: nothing was streamed"
    assert [c["index"] for c in chunks] == list(range(len(chunks)))
    assert {c["conversation_id"] for c in chunks} == {result["conversation_id"]}
    assert "".join(c["text"] for c in chunks) == result["content"] == pushed["content"]
    index = read_index(daemon.layout.index_file(result["conversation_id"]))
    assert len(index) == 1 and index[0].response_id == result["response_id"]
    record = read_response(daemon.layout.response_file(result["response_id"]))
    assert record is not None and record.content == result["content"]
    assert [line["type"] for line in record.inputs] == ["user"]


async def test_echo_streams_chunks_in_order(daemon: Daemon) -> None:
    chunks, pushed, result = await stream_one(daemon, "completion:async", {"prompt": PROMPT, "stream": True})
    check_stream(daemon, chunks, pushed, result)
    assert result["content"].startswith(f"You said: {PROMPT}")


async def test_stub_streams_over_sse(stub_daemon: Daemon, stub: Any) -> None:
    chunks, pushed, result = await stream_one(stub_daemon, "completion:async", {"prompt": PROMPT, "stream": True})
    check_stream(stub_daemon, chunks, pushed, result)
    assert stub.requests[-1]["stream"] is True
    assert result["content"] == f"stub answer to: {PROMPT}"
    assert len(chunks) == len(result["content"].split(" "))


async def test_agent_message_streams(daemon: Daemon, client: KsiClient) -> None:
    await client.request("agent:spawn", {"agent_id": "streamer", "profile": "assistant"})
    chunks, pushed, result = await stream_one(
        daemon, "agent:send_message", {"agent_id": "streamer", "message": PROMPT, "stream": True})
    check_stream(daemon, chunks, pushed, result)
    assert result["agent_id"] == "streamer"


async def test_no_chunks_without_stream(daemon: Daemon) -> None:
    async with connected(daemon) as watcher, connected(daemon) as client:
        await watcher.request("monitor:subscribe", {"patterns": ["completion:*"]})
        ack = await client.request("completion:async", {"prompt": PROMPT})
        chunks, _pushed = await collect(watcher, ack["request_id"])
    assert chunks == []
