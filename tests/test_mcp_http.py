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
from tests.stub_openai import StubOpenAI
from tests.test_mcp_stdio import (
    SLOW, assert_reported_the_slow_answer, call, call_waiting_on_progress, judge_or_answer, refused,
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
