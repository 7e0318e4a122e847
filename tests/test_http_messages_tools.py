"""Tool exchanges through the Messages door with the official `anthropic` SDK, on both storage
backends: the model's tool_use blocks, the client's tool_result blocks (is_error, content lists,
an image inside one) in a resent history, the final answer; and one conversation carried from
/v1/messages through /v1/responses and back, to an OpenAI-style and an Anthropic-style provider, every call paired
with its result at the provider."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from tests.conftest import HttpDaemon, running_http_daemon, stub_settings
from tests.image_bytes import png
from tests.stub_openai import Reply, StubOpenAI
from tests.test_http_messages import MODEL, conversations, sdk

pytestmark = pytest.mark.backends

WEATHER: Any = {"name": "weather", "description": "the weather in a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CLOCK: Any = {"name": "clock", "description": "the time in a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture
async def http(short_tmp: Path, stub: StubOpenAI, backend: dict[str, Any],
               monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[HttpDaemon]:
    monkeypatch.setenv("KSI_TEST_ANTHROPIC_KEY", "sk-ant-stub")
    claude = {"api_base": f"http://127.0.0.1:{stub.port}", "api_key_env": "KSI_TEST_ANTHROPIC_KEY"}
    async with running_http_daemon(short_tmp, **stub_settings(stub, models={"anthropic/stub*": claude}),
                                   **backend) as running:
        yield running


@pytest.fixture
async def client(http: HttpDaemon) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with sdk(http) as api:
        yield api


def sent(stub: StubOpenAI, index: int = -1) -> list[tuple[Any, ...]]:
    """What the OpenAI-style provider was sent: messages, calls and results, in order."""
    turns: list[tuple[Any, ...]] = []
    for message in stub.messages(index):
        if message.get("tool_calls"):
            turns.append(("assistant", [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
                                        for c in message["tool_calls"]]))
        elif message["role"] == "tool":
            turns.append(("tool", message["tool_call_id"], message["content"]))
        elif message["role"] != "system":
            turns.append((message["role"], message["content"]))
    return turns


def call(name: str, city: str, call_id: str) -> dict[str, Any]:
    return {"id": call_id, "name": name, "arguments": {"city": city}}


async def test_a_tool_loop_with_the_history_resent(
        http: HttpDaemon, client: anthropic.AsyncAnthropic, stub: StubOpenAI) -> None:
    stub.enqueue(Reply(calls=[call("weather", "Oslo", "toolu_w"), call("clock", "Lima", "toolu_c")]))
    ask: Any = {"role": "user", "content": "Oslo weather, Lima time?"}
    first = await client.messages.create(model=MODEL, max_tokens=100, tools=[WEATHER, CLOCK], messages=[ask])
    assert first.stop_reason == "tool_use"
    assert [(b.type, b.id, b.name, b.input) for b in first.content] == [  # type: ignore[union-attr]
        ("tool_use", "toolu_w", "weather", {"city": "Oslo"}), ("tool_use", "toolu_c", "clock", {"city": "Lima"})]
    assert stub.requests[-1]["tools"][0] == {"type": "function", "function": {
        "name": "weather", "description": "the weather in a city", "parameters": WEATHER["input_schema"]}}
    results: Any = {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_w", "content": [{"type": "text", "text": "12C"},
                                                                      {"type": "text", "text": "rain"}]},
        {"type": "tool_result", "tool_use_id": "toolu_c", "content": "clock is down", "is_error": True}]}
    history: Any = [ask, {"role": "assistant", "content": [b.model_dump() for b in first.content]}, results]
    stub.enqueue("Oslo: 12C and rain; no time for Lima.")
    final = await client.messages.create(model=MODEL, max_tokens=100, tools=[WEATHER, CLOCK], messages=history)
    assert final.stop_reason == "end_turn" and final.content[0].text == "Oslo: 12C and rain; no time for Lima."  # type: ignore[union-attr]
    pairs = [("user", "Oslo weather, Lima time?"),
             ("assistant", [("toolu_w", "weather", {"city": "Oslo"}), ("toolu_c", "clock", {"city": "Lima"})]),
             ("tool", "toolu_w", "12C\nrain"), ("tool", "toolu_c", "[tool error] clock is down")]
    assert sent(stub) == pairs
    history += [{"role": "assistant", "content": [b.model_dump() for b in final.content]},
                {"role": "user", "content": "thanks"}]
    await client.messages.create(model=MODEL, max_tokens=100, tools=[WEATHER, CLOCK], messages=history)
    assert sent(stub) == [*pairs, ("assistant", "Oslo: 12C and rain; no time for Lima."), ("user", "thanks")]
    assert list((await conversations(http)).values()) == [3]


async def test_a_tool_exchange_carried_through_responses_and_back(
        http: HttpDaemon, client: anthropic.AsyncAnthropic, stub: StubOpenAI) -> None:
    # 1: a call made and answered through /v1/messages
    stub.enqueue(Reply(calls=[call("weather", "Oslo", "toolu_1")]))
    raw = await client.messages.with_raw_response.create(
        model=MODEL, max_tokens=100, tools=[WEATHER], messages=[{"role": "user", "content": "Weather in Oslo?"}])
    conversation_id = raw.headers["x-ksi-conversation-id"]
    named = {"x-ksi-conversation-id": conversation_id}
    await client.messages.create(model=MODEL, max_tokens=100, tools=[WEATHER], extra_headers=named, messages=[
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "12C"}]}])
    # 2: the same conversation through /v1/responses, with a function tool of its own
    async with openai.AsyncOpenAI(base_url=f"{http.base_url}/v1", api_key=http.token, max_retries=0) as api:
        stub.enqueue(Reply(calls=[call("clock", "Lima", "call_2")]))
        function: Any = {"type": "function", "name": "clock", "description": "the time in a city",
                         "parameters": CLOCK["input_schema"]}
        made = await api.responses.create(model=MODEL, input="And the time in Lima?", tools=[function],
                                          conversation=conversation_id)
        assert [item.type for item in made.output] == ["function_call"]
        await api.responses.create(model=MODEL, tools=[function], conversation=conversation_id, input=[
            {"type": "function_call_output", "call_id": "call_2", "output": "09:30"}])
    # 3: back through /v1/messages, on an Anthropic-style model this time
    stub.enqueue(Reply(calls=[call("weather", "Bergen", "toolu_3")]))
    third = await client.messages.create(model="anthropic/stub-claude", max_tokens=100, tools=[WEATHER, CLOCK],
                                         extra_headers=named, messages=[{"role": "user", "content": "Bergen?"}])
    assert [b.type for b in third.content] == ["tool_use"]
    body = stub.anthropic_requests[-1]
    tool_uses = [(b["id"], b["name"]) for m in body["messages"] if m["role"] == "assistant"
                 for b in m["content"] if isinstance(b, dict) and b.get("type") == "tool_use"]
    tool_results = [(b["tool_use_id"], b["content"]) for m in body["messages"] if m["role"] == "user"
                    and isinstance(m["content"], list) for b in m["content"] if b.get("type") == "tool_result"]
    assert tool_uses == [("toolu_1", "weather"), ("call_2", "clock")]
    assert tool_results == [("toolu_1", "12C"), ("call_2", "09:30")]
    # 4: and answered through /v1/messages on the OpenAI-style model: every pair intact there too
    await client.messages.create(model=MODEL, max_tokens=100, tools=[WEATHER, CLOCK], extra_headers=named,
                                 messages=[{"role": "user", "content": [
                                     {"type": "tool_result", "tool_use_id": "toolu_3", "content": "8C"}]}])
    calls_and_results = [turn for turn in sent(stub) if turn[0] == "tool" or isinstance(turn[1], list)]
    assert calls_and_results == [
        ("assistant", [("toolu_1", "weather", {"city": "Oslo"})]), ("tool", "toolu_1", "12C"),
        ("assistant", [("call_2", "clock", {"city": "Lima"})]), ("tool", "call_2", "09:30"),
        ("assistant", [("toolu_3", "weather", {"city": "Bergen"})]), ("tool", "toolu_3", "8C")]
    assert await conversations(http) == {conversation_id: 6}


async def test_thinking_reaches_a_model_called_through_anthropic(
        client: anthropic.AsyncAnthropic, stub: StubOpenAI) -> None:
    thinking: Any = {"type": "enabled", "budget_tokens": 1024}
    raw = await client.messages.with_raw_response.create(
        model="anthropic/stub-claude", max_tokens=2000, thinking=thinking, messages=[{"role": "user", "content": "hi"}])
    assert "x-ksi-unsent" not in raw.headers
    assert stub.anthropic_requests[-1]["thinking"] == thinking


async def test_an_image_in_a_tool_result_reaches_the_model_in_the_users_message_and_again_on_the_next_turn(
        http: HttpDaemon, client: anthropic.AsyncAnthropic, stub: StubOpenAI) -> None:
    """Claude Code's Read tool returns an image it read as an image block inside the tool_result."""
    data = base64.b64encode(png(16, 16)).decode()
    read = {"name": "read", "description": "read a file",
            "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}
    stub.enqueue(Reply(calls=[{"id": "toolu_r", "name": "read", "arguments": {"path": "shot.png"}}]))
    ask: Any = {"role": "user", "content": "What is in shot.png?"}
    first = await client.messages.create(model=MODEL, max_tokens=100, tools=[read], messages=[ask])
    result: Any = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_r", "content": [
        {"type": "text", "text": "shot.png, 16x16"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}]}]}
    history: Any = [ask, {"role": "assistant", "content": [b.model_dump() for b in first.content]}, result]
    stub.enqueue("A grey square.", "You are welcome.")
    await client.messages.create(model=MODEL, max_tokens=100, tools=[read], messages=history)
    shown = [("tool", "toolu_r", "shot.png, 16x16\n[1 attachment of this result: in the user's message]"),
             ("user", [{"type": "text", "text": "[attachments of the result of toolu_r]"},
                       {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}])]
    assert sent(stub)[2:] == shown
    history += [{"role": "assistant", "content": "A grey square."}, {"role": "user", "content": "thanks"}]
    await client.messages.create(model=MODEL, max_tokens=100, tools=[read], messages=history)
    assert sent(stub)[2:] == [*shown, ("assistant", "A grey square."), ("user", "thanks")]
    assert list((await conversations(http)).values()) == [3]
