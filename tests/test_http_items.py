"""A tool-using conversation through the OpenAI door, read with the openai SDK: the Conversations
API lists its calls, tool outputs, reasoning summary and image reference as items, and a response's
input items hold its tool outputs."""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest

from tests.conftest import HttpDaemon
from tests.test_http_openai import request, sdk
from tests.tool_conversation import IMAGE_SHA, store_image, tool_document


@pytest.fixture
async def client(http_daemon: HttpDaemon) -> AsyncIterator[openai.AsyncOpenAI]:
    async with sdk(http_daemon) as api:
        yield api


async def test_conversation_items_and_input_items_of_a_tool_conversation(
        http_daemon: HttpDaemon, client: openai.AsyncOpenAI) -> None:
    await store_image(http_daemon.daemon)
    await request(http_daemon, "conversation:import", {"data": tool_document(), "new_id": "tools"})
    listed = (await client.conversations.items.list("tools", order="asc")).data
    assert [item.type for item in listed] == ["message", "message", "function_call", "function_call_output",
                                              "message", "message", "reasoning", "message"]
    call = listed[2]
    assert (call.call_id, call.name, call.arguments) == ("c1", "weather", '{"city": "Oslo"}')  # type: ignore[union-attr]
    assert (listed[3].call_id, listed[3].output) == ("c1", "12C")  # type: ignore[union-attr]
    picture = listed[5].content  # type: ignore[union-attr]
    assert picture[0].text == "And what is in this picture?"
    assert (picture[1].type, picture[1].file_id) == ("input_image", f"sha256:{IMAGE_SHA}")
    assert listed[6].summary[0].text == "looked at the whiskers"  # type: ignore[union-attr]
    assert listed[7].content[0].text == "A cat."  # type: ignore[union-attr]

    shown = await request(http_daemon, "conversation:show", {"conversation_id": "tools"})
    answered = shown["exchanges"][1]["response_id"]
    inputs = (await client.responses.input_items.list(answered, order="asc")).data
    assert [(item.type, item.call_id, item.output) for item in inputs] == [  # type: ignore[union-attr]
        ("function_call_output", "c1", "12C")]
