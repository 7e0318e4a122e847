"""The MCP server at /mcp on the daemon's HTTP front, driven by the official client's
streamable-HTTP transport, behind the front's bearer token."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx2
import mcp_types as types
import openai
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from tests.conftest import HttpDaemon, connected, running_http_daemon, stub_settings
from tests.stub_openai import Reply, StubOpenAI
from tests.test_mcp_stdio import (
    SLOW,
    SLOW_ANSWER,
    assert_reported_the_slow_answer,
    call,
    call_waiting_on_progress,
    judge_or_answer,
    refused,
)


@asynccontextmanager
async def mcp_over_http(front: HttpDaemon, token: str | None = None, mode: str = "auto") -> AsyncIterator[Client]:
    headers = {"Authorization": f"Bearer {front.token if token is None else token}"}
    async with httpx2.AsyncClient(headers=headers, timeout=30) as http:
        async with Client(streamable_http_client(f"{front.base_url}/mcp", http_client=http), mode=mode) as client:
            yield client


async def test_tools_and_resources_over_streamable_http(short_tmp: Path) -> None:
    async with StubOpenAI(answer=judge_or_answer) as stub, \
            running_http_daemon(short_tmp, **stub_settings(stub)) as front, mcp_over_http(front) as client:
        assert [tool.name for tool in (await client.list_tools()).tools] == [
            "chat", "consensus", "conversations", "conversation", "fork", "agent_message"]
        cid = (await call(client, "chat", prompt="Where is the lighthouse?"))["continuation_id"]
        second = await call(client, "chat", prompt="How tall?", continuation_id=cid)
        assert second["continuation_id"] == cid
        assert [m["content"] for m in stub.messages()] == [
            "Where is the lighthouse?", "stub answer to: Where is the lighthouse?", "How tall?"]
        agreed = await call(client, "consensus", prompt="Built when?", continuation_id=cid, models=["openai/stub-a"])
        assert agreed["answer"] == "the members agree" and agreed["dissent"] == "B doubts the date"

        # the same conversation continues through OpenAI's Responses API, then here again
        async with openai.AsyncOpenAI(base_url=f"{front.base_url}/v1", api_key=front.token, max_retries=0) as api:
            await api.responses.create(input="from the Responses API", conversation=cid, model="openai/stub-model")
        await call(client, "chat", prompt="back in MCP", continuation_id=cid)
        assert [m["content"] for m in stub.messages()][-3:] == [
            "from the Responses API", "stub answer to: from the Responses API", "back in MCP"]

        found = await call(client, "conversations", query="lighthouse")
        assert [c["continuation_id"] for c in found["conversations"]] == [cid]
        assert found["conversations"][0]["turns"] == 5
        transcript = await client.call_tool("conversation", {"continuation_id": cid})
        assert "from the Responses API" in transcript.content[0].text
        fork = await call(client, "fork", continuation_id=cid, at=2)
        assert fork["parent_id"] == cid
        page = await client.read_resource(f"ksi://conversations/{fork['continuation_id']}")
        assert "How tall?" in page.contents[0].text and "from the Responses API" not in page.contents[0].text
        await refused(client, "conversation_not_found", "chat", prompt="hi", continuation_id="nope")
        await refused(client, "validation_error", "fork", continuation_id=cid, at="two")


async def test_listen_stream_hears_a_new_exchange(http_daemon: HttpDaemon) -> None:
    async with mcp_over_http(http_daemon) as client:
        cid = (await call(client, "chat", prompt="first"))["continuation_id"]
        uri = f"ksi://conversations/{cid}"
        async with client.listen(resource_subscriptions=[uri]) as subscription:
            await call(client, "chat", prompt="second", continuation_id=cid)
            async with asyncio.timeout(10):
                event = await anext(aiter(subscription))
        assert event.uri == uri


@pytest.mark.filterwarnings("ignore:resources/subscribe is removed")  # the legacy era, on purpose
async def test_legacy_session_subscription_over_http(http_daemon: HttpDaemon) -> None:
    updated: asyncio.Queue[str] = asyncio.Queue()

    async def on_message(message: Any) -> None:
        if isinstance(message, types.ResourceUpdatedNotification):
            updated.put_nowait(message.params.uri)

    headers = {"Authorization": f"Bearer {http_daemon.token}"}
    async with httpx2.AsyncClient(headers=headers, timeout=30) as http:
        transport = streamable_http_client(f"{http_daemon.base_url}/mcp", http_client=http)
        async with Client(transport, mode="legacy", message_handler=on_message) as client:
            cid = (await call(client, "chat", prompt="first"))["continuation_id"]
            await client.session.subscribe_resource("ksi://conversations")
            async with connected(http_daemon.daemon) as socket:
                await socket.request("conversation:update", {"conversation_id": cid, "title": "renamed"})
            assert await asyncio.wait_for(updated.get(), 10) == "ksi://conversations"
            listing = json.loads((await client.read_resource("ksi://conversations")).contents[0].text)
            assert listing["conversations"][0]["title"] == "renamed"


async def test_mcp_needs_the_token(http_daemon: HttpDaemon) -> None:
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    async with httpx2.AsyncClient(timeout=30) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            response = await http.post(f"{http_daemon.base_url}/mcp", json=body,
                                       headers={**headers, "Accept": "application/json, text/event-stream"})
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "unauthorized"


@pytest.mark.parametrize("mode", ["auto", "legacy"])  # a single exchange (2026) and a session (2025)
async def test_a_long_call_reports_progress_over_http(http_daemon: HttpDaemon, stub: StubOpenAI, mode: str) -> None:
    async with mcp_over_http(http_daemon, mode=mode) as client:
        await call(client, "chat", prompt="warm up")  # the daemon's first call loads litellm
        stub.enqueue(SLOW)
        result, reports = await call_waiting_on_progress(client, "chat", prompt="climb")
    assert_reported_the_slow_answer(result, reports)


async def test_unknown_tool_is_invalid_params_over_http(http_daemon: HttpDaemon) -> None:
    from mcp.shared.exceptions import MCPError

    async with mcp_over_http(http_daemon) as client:
        with pytest.raises(MCPError) as unknown:
            await client.call_tool("no_such_tool", {})
    assert unknown.value.error.code == types.INVALID_PARAMS


async def sse_events(response: Any) -> AsyncIterator[dict[str, str]]:
    """The events of an SSE response: their `id`, `retry`, `event` and `data` fields."""
    event: dict[str, str] = {}
    async for line in response.aiter_lines():
        if not line:
            if event:
                yield event
            event = {}
            continue
        name, _colon, value = line.partition(":")
        if name:  # a line starting with a colon is a comment
            event[name] = value.removeprefix(" ")


async def test_a_dropped_stream_is_resumed_with_last_event_id(http_daemon: HttpDaemon, stub: StubOpenAI) -> None:
    url = f"{http_daemon.base_url}/mcp"
    version = "2025-11-25"  # the first revision whose streams are resumable
    headers = {"Authorization": f"Bearer {http_daemon.token}", "Accept": "application/json, text/event-stream"}
    async with httpx2.AsyncClient(headers=headers, timeout=30) as http:
        opened = await http.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": version, "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}})
        assert opened.status_code == 200, opened.text
        session = {"Mcp-Session-Id": opened.headers["mcp-session-id"], "MCP-Protocol-Version": version}
        await http.post(url, json={"jsonrpc": "2.0", "method": "notifications/initialized"}, headers=session)
        warm = await http.post(url, headers=session, json={"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                                                            "params": {"name": "chat", "arguments": {"prompt": "warm up"}}})
        assert "stub answer to: warm up" in warm.text

        stub.enqueue(Reply(text=SLOW_ANSWER, delay=1.0, drip=0.5))
        slow = {"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {
            "name": "chat", "arguments": {"prompt": "climb"}, "_meta": {"progressToken": "climb"}}}
        before: list[dict[str, str]] = []
        async with http.stream("POST", url, json=slow, headers=session) as response:
            async for event in sse_events(response):
                before.append(event)
                if "notifications/progress" in event.get("data", ""):
                    break  # the stream drops here, with the answer still to come
        assert before[0]["retry"] == "1000" and before[0]["data"] == ""  # the priming event
        assert all(event.get("id") for event in before)

        after: list[dict[str, str]] = []
        resumed = {**session, "Last-Event-ID": before[-1]["id"]}
        async with asyncio.timeout(30), http.stream("GET", url, headers=resumed) as response:
            assert response.status_code == 200
            async for event in sse_events(response):
                after.append(event)
                if json.loads(event["data"] or "{}").get("id") == 3:
                    break

        # another session (whose request ids are the same) is replayed nothing of this one
        other = await http.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": version, "capabilities": {}, "clientInfo": {"name": "u", "version": "1"}}})
        elsewhere = {"Mcp-Session-Id": other.headers["mcp-session-id"], "MCP-Protocol-Version": version,
                     "Last-Event-ID": before[-1]["id"]}
        async with asyncio.timeout(30), http.stream("GET", url, headers=elsewhere) as response:
            assert [event async for event in sse_events(response)] == []
    assert all(event.get("id") for event in after)
    assert not {event["id"] for event in after} & {event["id"] for event in before}  # only what was missed
    messages = [json.loads(event["data"]) for event in after if event["data"]]
    answer = messages[-1]["result"]["structuredContent"]
    assert answer["answer"] == SLOW_ANSWER
    progress = [m["params"]["progress"] for m in messages if m.get("method") == "notifications/progress"]
    last_seen = json.loads(before[-1]["data"])["params"]["progress"]
    assert progress == sorted(set(progress)) and all(value > last_seen for value in progress)
    assert len(stub.requests) == 2  # resuming asked nothing again
    assert (await call_list(http_daemon))["total"] == 2


async def call_list(front: HttpDaemon) -> dict[str, Any]:
    async with mcp_over_http(front) as client:
        return await call(client, "conversations")


async def test_kept_events_are_bounded_and_replayed_only_to_their_session() -> None:
    """The event store behind SessionScoped, with a stand-in for the SDK's transport: a request
    that opens session s1 stores events, later requests (named by their session) replay them."""
    from mcp.server.streamable_http import EventMessage
    from mcp_types import JSONRPCNotification

    from ksi_daemon.transports.http.mcp_events import SessionEventStore, SessionScoped

    store = SessionEventStore(max_events=4)
    ids: list[str] = []
    replayed: list[list[str]] = []

    async def opening(_scope: Any, _receive: Any, send: Any) -> None:
        for n in range(6):
            ids.append(await store.store_event("2", JSONRPCNotification(jsonrpc="2.0", method=f"m{n}")))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"mcp-session-id", b"s1")]})

    async def resuming(scope: Any, _receive: Any, _send: Any) -> None:
        seen: list[str] = []

        async def collect(event: EventMessage) -> None:
            seen.append(event.message.method)  # type: ignore[union-attr]

        await store.replay_events_after(scope["last_event_id"], collect)
        replayed.append(seen)

    async def ignore(_message: Any) -> None:
        pass

    def http(session: str | None, **extra: Any) -> dict[str, Any]:
        headers = [(b"mcp-session-id", session.encode())] if session else []
        return {"type": "http", "headers": headers, **extra}

    await SessionScoped(opening)(http(None), ignore, ignore)
    for session, after in (("s1", ids[0]), ("s1", ids[3]), ("s2", ids[3])):
        await SessionScoped(resuming)(http(session, last_event_id=after), ignore, ignore)
    # the two oldest were forgotten; another session gets nothing of s1's
    assert replayed == [[], ["m4", "m5"], []]
