"""Hostile providers: one that drips its answer byte by byte is cut off by the request timeout,
one that sends a gigantic answer is refused by the size limit; the daemon stays healthy and the
conversation's history stays clean."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from ksi_common.client import KsiClient
from ksi_common.records import read_index, read_response
from ksi_daemon.daemon import Daemon
from tests.conftest import connected, running_daemon, stub_settings
from tests.stub_openai import Reply, StubOpenAI

TIMEOUT = 60.0


def completion_body(text: str) -> str:
    return json.dumps({
        "id": "chatcmpl-drip", "object": "chat.completion", "created": int(time.time()), "model": "stub",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    })


async def fail(client: KsiClient, **data: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run a completion expected to fail: (the ack, the error of completion:wait)."""
    ack = await client.request("completion:async", data)
    frame = await client.send_frame("completion:wait", {"request_id": ack["request_id"], "timeout": TIMEOUT})
    assert "error" in frame, frame
    return ack, frame["error"]


async def assert_clean_and_healthy(daemon: Daemon, client: KsiClient, conversation_id: str, stub: StubOpenAI) -> None:
    """The failed exchanges are logged but not indexed, and the next one works and sees no trace."""
    layout = daemon.layout
    assert read_index(layout.index_file(conversation_id)) == []
    errors = [read_response(p) for p in layout.responses_dir.glob("*.jsonl")]
    assert errors and all(r is not None and r.outcome and r.outcome["type"] == "error" for r in errors)
    health = await client.request("system:health")
    assert health["status"] == "healthy"
    ack = await client.request("completion:async", {"prompt": "still there?", "conversation_id": conversation_id})
    result = await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": TIMEOUT})
    assert result["content"] == "stub answer to: still there?"
    assert [m["role"] for m in stub.messages()] == ["user"]  # no failed exchange in the history
    assert len(read_index(layout.index_file(conversation_id))) == 1


async def test_slow_loris_provider_is_cut_off_by_the_request_timeout(short_tmp: Path, stub: StubOpenAI) -> None:
    # headers at once, then the body one byte every 0.2 s: no read ever times out, the request must
    stub.enqueue(Reply(body=completion_body("slow " * 50), drip=0.2), Reply(body=completion_body("slow"), drip=0.2))
    async with running_daemon(short_tmp, **stub_settings(stub, retry_attempts=2)) as daemon, \
            connected(daemon) as client:
        ack, error = await fail(client, prompt="hello", conversation_id="loris", create=True, timeout=1.0)
        assert error["code"] == "timeout"
        stub.script.clear()  # under load the first attempt may time out before it reaches the stub
        status = await client.request("completion:status", {"request_id": ack["request_id"]})
        assert status["status"] == "failed" and status["reason"] == "timeout"
        (record,) = [read_response(p) for p in daemon.layout.responses_dir.glob("*.jsonl")]
        assert record is not None and record.outcome is not None
        attempts = record.outcome["attempts"]
        assert [a["code"] for a in attempts] == ["timeout", "timeout"]
        assert all(900 <= a["duration_ms"] < 2500 for a in attempts)  # each cut off after its second
        await assert_clean_and_healthy(daemon, client, "loris", stub)


async def test_gigantic_answer_is_refused_by_the_size_limit(short_tmp: Path, stub: StubOpenAI) -> None:
    stub.enqueue(Reply(text="x" * (20 * 1024 * 1024)))
    async with running_daemon(short_tmp, **stub_settings(stub, max_response_bytes=1024 * 1024)) as daemon, \
            connected(daemon) as client:
        _ack, error = await fail(client, prompt="tell me everything", conversation_id="huge", create=True)
        assert error["code"] == "provider_error"
        assert error["details"]["limit"] == 1024 * 1024
        assert error["details"]["reason"] == "response_too_large"
        assert len(json.dumps(error)) < 10_000  # the answer itself is not echoed back
        await assert_clean_and_healthy(daemon, client, "huge", stub)
        # nothing of the giant answer was written to disk either
        assert sum(p.stat().st_size for p in daemon.layout.logs_dir.rglob("*") if p.is_file()) < 2 * 1024 * 1024


async def test_gigantic_streamed_answer_is_refused_by_the_size_limit(short_tmp: Path, stub: StubOpenAI) -> None:
    word = "y" * 65536
    stub.enqueue(Reply(text=" ".join([word] * 320)))  # 20 MB in 320 chunks
    async with running_daemon(short_tmp, **stub_settings(stub, max_response_bytes=1024 * 1024)) as daemon, \
            connected(daemon) as client:
        _ack, error = await fail(client, prompt="stream it all", conversation_id="flood", create=True, stream=True)
        assert error["code"] == "provider_error"
        assert error["details"]["limit"] == 1024 * 1024
        assert error["details"]["reason"] == "response_too_large"
        await assert_clean_and_healthy(daemon, client, "flood", stub)
