"""A streamed answer on the console's send routes, read as the page reads it (server-sent events):
followed as every client follows one request, its outcome the request's own."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson

from ksi_common.errors import ErrorCode
from ksi_common.events import COMPLETION_CANCEL
from ksi_daemon.context import EventContext
from tests.conftest import HttpDaemon
from tests.stub_openai import Reply, StubOpenAI


def api(http: HttpDaemon) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=http.base_url, headers={"Authorization": f"Bearer {http.token}"}, timeout=30)


async def opened(http: HttpDaemon) -> str:
    async with api(http) as client:
        reply = await client.post("/v1/responses", json={"input": "first"})
    return str(reply.json()["conversation"]["id"])


async def answer_events(client: httpx.AsyncClient, conversation_id: str, prompt: str,
                        on_queued: Any = None) -> list[tuple[str, dict[str, Any]]]:
    events: list[tuple[str, dict[str, Any]]] = []
    async with client.stream("POST", f"/conversations/{conversation_id}/send", data={"prompt": prompt}) as reply:
        assert reply.status_code == 200
        name = "message"
        async for line in reply.aiter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                events.append((name, orjson.loads(line[6:])))
                if name == "queued" and on_queued is not None:
                    await on_queued(events[-1][1])
    return events


async def test_a_sent_prompt_streams_its_chunks_then_the_result(http_daemon: HttpDaemon, stub: StubOpenAI) -> None:
    conversation_id = await opened(http_daemon)
    stub.enqueue(Reply(text=" ".join(f"w{i}" for i in range(30))))
    async with api(http_daemon) as client:
        events = await answer_events(client, conversation_id, "many words")
    names = [name for name, _ in events]
    assert names[0] == "queued" and names[-1] == "result" and set(names[1:-1]) == {"chunk"}
    assert "".join(data["text"] for name, data in events if name == "chunk") == events[-1][1]["content"]


async def test_a_failed_answer_ends_with_the_error_its_event_carried(http_daemon: HttpDaemon,
                                                                    stub: StubOpenAI) -> None:
    conversation_id = await opened(http_daemon)
    stub.enqueue(*[Reply(status=400, body='{"error": {"message": "bad things", "type": "invalid_request_error"}}')]
                 * 3)
    async with api(http_daemon) as client:
        events = await answer_events(client, conversation_id, "fails")
    name, error = events[-1]
    assert [n for n, _ in events] == ["queued", "error"]
    assert error["code"] == ErrorCode.PROVIDER_ERROR and error["message"]
    assert error["request_id"] == events[0][1]["request_id"] and error["conversation_id"] == conversation_id
    assert "request_id" not in error["details"]  # as completion:error carries it: the wait's naming is not added


async def test_a_cancelled_answer_ends_with_cancelled(http_daemon: HttpDaemon, stub: StubOpenAI) -> None:
    conversation_id = await opened(http_daemon)
    gate = asyncio.Event()  # never set: the answer holds after its first chunk until cancelled
    stub.enqueue(Reply(text="held here", gate=gate))

    async def cancel(ack: dict[str, Any]) -> None:
        await http_daemon.daemon._handle_request(COMPLETION_CANCEL, {"request_id": ack["request_id"]},
                                                 EventContext.root())

    async with api(http_daemon) as client:
        events = await answer_events(client, conversation_id, "held", on_queued=cancel)
    name, error = events[-1]
    assert name == "cancelled" and error["code"] == ErrorCode.CANCELLED
    assert error["details"] == {"request_id": events[0][1]["request_id"]}
