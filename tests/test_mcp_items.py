"""The MCP transcript of a tool-using conversation, through the official client over stdio
(`ksi mcp`) and over the HTTP front: the `conversation` tool and the conversation resource show
tool calls, their outputs, a reasoning summary and image references."""

from __future__ import annotations

import json
from pathlib import Path

from mcp import Client

from tests.conftest import HttpDaemon, connected, running_daemon
from tests.test_cli_ask import where
from tests.test_mcp_http import mcp_over_http
from tests.test_mcp_stdio import mcp_session
from tests.tool_conversation import IMAGE_SHA, store_image, tool_document

CALL = {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Oslo"}'}


async def shows_the_items(client: Client) -> None:
    transcript = await client.call_tool("conversation", {"continuation_id": "tools"})
    assert not transcript.is_error, transcript.content
    text = transcript.content[0].text
    for expected in ("**Tool call** `weather` (call `c1`)", '{"city": "Oslo"}', "**Tool output** (call `c1`)",
                     "12C", f"[image sha256:{IMAGE_SHA[:12]}\u2026 image/png 3 KB]",
                     "**Reasoning summary**\n\n> looked at the whiskers"):
        assert expected in text, (expected, text)
    as_json = await client.call_tool("conversation", {"continuation_id": "tools", "format": "json"})
    exchanges = json.loads(as_json.content[0].text)["exchanges"]
    assert exchanges[0]["output"][1] == CALL
    assert exchanges[1]["input"] == [{"type": "function_call_output", "call_id": "c1", "output": "12C"}]
    page = await client.read_resource("ksi://conversations/tools")
    assert "**Tool output** (call `c1`)" in page.contents[0].text


async def test_the_stdio_transcript_shows_tool_calls_outputs_and_images(short_tmp: Path) -> None:
    async with running_daemon(short_tmp) as daemon:
        await store_image(daemon)
        async with connected(daemon) as socket:
            await socket.request("conversation:import", {"data": tool_document(), "new_id": "tools"})
        async with mcp_session(short_tmp, *where(short_tmp)) as client:
            await shows_the_items(client)


async def test_the_http_transcript_shows_tool_calls_outputs_and_images(http_daemon: HttpDaemon) -> None:
    await store_image(http_daemon.daemon)
    async with connected(http_daemon.daemon) as socket:
        await socket.request("conversation:import", {"data": tool_document(), "new_id": "tools"})
    async with mcp_over_http(http_daemon) as client:
        await shows_the_items(client)
