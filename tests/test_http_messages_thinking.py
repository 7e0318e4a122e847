"""Signed thinking through the Messages door with the official `anthropic` SDK, on both storage
backends: an Anthropic model's `thinking` (with its signature) and `redacted_thinking` blocks come
back as they came, waited for and streamed (`thinking_delta`, `signature_delta`); they are kept as
the exchange's reasoning item, replayed to the Anthropic model on the next turn (stored or resent by
the client) and never to an OpenAI-style model; the turn continues on /v1/responses with them."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from tests.conftest import HttpDaemon, running_http_daemon, stub_settings
from tests.stub_openai import Reply, StubOpenAI
from tests.test_http_messages import sdk

pytestmark = pytest.mark.backends

CLAUDE = "anthropic/stub-claude"
SIGNED = {"type": "thinking", "thinking": "look it up", "signature": "sig-1"}
REDACTED = {"type": "redacted_thinking", "data": "opaque-1"}
QUESTION: Any = {"role": "user", "content": "Oslo weather?"}
THINK: Any = {"type": "enabled", "budget_tokens": 1024}
WEATHER: Any = {"name": "weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


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


def thinking_reply() -> Reply:
    return Reply(thinking=("look it up", "sig-1"), redacted="opaque-1",
                 calls=[{"id": "toolu_1", "name": "weather", "arguments": {"city": "Oslo"}}])


async def ask(client: anthropic.AsyncAnthropic, stream: bool, **body: Any) -> Any:
    if not stream:
        return await client.messages.create(max_tokens=100, tools=[WEATHER], **body)
    async with client.messages.stream(max_tokens=100, tools=[WEATHER], **body) as events:
        return await events.get_final_message()


@pytest.mark.parametrize("stream", [False, True])
async def test_signed_thinking_comes_back_and_is_replayed_only_to_anthropic(
        client: anthropic.AsyncAnthropic, stub: StubOpenAI, stream: bool) -> None:
    stub.enqueue(thinking_reply())
    question: Any = {"role": "user", "content": "Oslo weather?"}
    first = await ask(client, stream, model=CLAUDE, messages=[question],
                      thinking={"type": "enabled", "budget_tokens": 1024})
    blocks = [block.model_dump(exclude_none=True) for block in first.content]
    assert [block for block in blocks if block["type"] != "tool_use"] == [SIGNED, REDACTED]

    # the client resends its history, thinking blocks and all: it matches, and Anthropic gets them back
    history: Any = [question, {"role": "assistant", "content": blocks},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "12C"}]}]
    stub.enqueue("12C in Oslo.")
    raw = await client.messages.with_raw_response.create(model=CLAUDE, max_tokens=100, tools=[WEATHER],
                                                         messages=history)
    assert (await raw.parse()).content[0].text == "12C in Oslo."  # type: ignore[union-attr]
    replayed = stub.anthropic_requests[-1]["messages"][1]["content"]
    assert replayed[:2] == [SIGNED, REDACTED]
    assert replayed[-1]["type"] == "tool_use"

    # an OpenAI-style model on the same conversation: the calls and results, no reasoning
    conversation_id = raw.headers["x-ksi-conversation-id"]
    stub.enqueue("done")
    await client.messages.create(model="openai/stub-model", max_tokens=100, tools=[WEATHER],
                                 messages=[{"role": "user", "content": "thanks"}],
                                 extra_headers={"x-ksi-conversation-id": conversation_id})
    sent = stub.messages()
    assert not any("thinking_blocks" in message or "reasoning_content" in message for message in sent)
    assert [call["id"] for message in sent for call in message.get("tool_calls") or []] == ["toolu_1"]


async def test_thinking_made_here_is_replayed_after_a_turn_on_responses(
        http: HttpDaemon, client: anthropic.AsyncAnthropic, stub: StubOpenAI) -> None:
    stub.enqueue(thinking_reply())
    raw = await client.messages.with_raw_response.create(
        model=CLAUDE, max_tokens=100, tools=[WEATHER], messages=[{"role": "user", "content": "Oslo weather?"}])
    conversation_id = raw.headers["x-ksi-conversation-id"]
    async with openai.AsyncOpenAI(base_url=f"{http.base_url}/v1", api_key=http.token, max_retries=0) as responses:
        stub.enqueue("12C in Oslo.")
        await responses.responses.create(
            model=CLAUDE, conversation=conversation_id,
            tools=[{"type": "function", "name": "weather", "parameters": WEATHER["input_schema"]}],
            input=[{"type": "function_call_output", "call_id": "toolu_1", "output": "12C"}])
    assert stub.anthropic_requests[-1]["messages"][1]["content"][:2] == [SIGNED, REDACTED]
    # and back on this door: the stored turn still carries them to Anthropic
    stub.enqueue("Bye.")
    await client.messages.create(model=CLAUDE, max_tokens=100, messages=[{"role": "user", "content": "bye"}],
                                 extra_headers={"x-ksi-conversation-id": conversation_id})
    assert stub.anthropic_requests[-1]["messages"][1]["content"][:2] == [SIGNED, REDACTED]


async def test_a_thinking_block_without_its_text_is_refused(
        client: anthropic.AsyncAnthropic, stub: StubOpenAI) -> None:
    history: Any = [{"role": "user", "content": "hi"},
                    {"role": "assistant", "content": [{"type": "thinking", "signature": "s"},
                                                      {"type": "text", "text": "hello"}]},
                    {"role": "user", "content": "again"}]
    with pytest.raises(anthropic.BadRequestError) as refused:
        await client.messages.create(model=CLAUDE, max_tokens=100, messages=history)
    assert refused.value.body["error"]["code"] == "validation_error"  # type: ignore[index]
    assert "messages.1.content.0" in refused.value.body["error"]["details"]["fields"]  # type: ignore[index]
    assert stub.anthropic_requests == []


async def streamed(client: anthropic.AsyncAnthropic, model: str) -> tuple[list[tuple[Any, ...]], Any]:
    """The stream's block events as (type, index, what) and its final message."""
    seen: list[tuple[Any, ...]] = []
    async with client.messages.stream(model=model, max_tokens=100, messages=[QUESTION], thinking=THINK) as events:
        async for event in events:
            if event.type == "content_block_start":
                seen.append(("start", event.index, event.content_block.type))
            elif event.type == "content_block_delta":
                delta = event.delta.model_dump()
                seen.append(("delta", event.index, delta["type"],
                             delta.get("thinking") or delta.get("signature") or delta.get("text")))
            elif event.type == "content_block_stop":
                seen.append(("stop", event.index))
        return seen, await events.get_final_message()


async def waited(client: anthropic.AsyncAnthropic, model: str) -> Any:
    return await client.messages.create(model=model, max_tokens=100, messages=[QUESTION], thinking=THINK)


async def test_signed_thinking_streams_as_it_comes_before_the_text(
        client: anthropic.AsyncAnthropic, stub: StubOpenAI) -> None:
    reply = Reply(thinking=("look it up", "sig-1"), redacted="opaque-1", text="Sunny.")
    stub.enqueue(reply, dataclasses.replace(reply))
    seen, final = await streamed(client, CLAUDE)
    assert seen == [("start", 0, "thinking"), ("delta", 0, "thinking_delta", "look "),
                    ("delta", 0, "thinking_delta", "it "), ("delta", 0, "thinking_delta", "up"),
                    ("delta", 0, "signature_delta", "sig-1"), ("stop", 0),
                    ("start", 1, "redacted_thinking"), ("stop", 1),
                    ("start", 2, "text"), ("delta", 2, "text_delta", "Sunny."), ("stop", 2)]
    whole = await waited(client, CLAUDE)
    assert [block.model_dump() for block in final.content] == [block.model_dump() for block in whole.content]
    assert [block.model_dump(exclude_none=True) for block in final.content][:2] == [SIGNED, REDACTED]


async def test_a_reasoning_summary_streams_as_a_thinking_block_before_the_text(
        client: anthropic.AsyncAnthropic, stub: StubOpenAI) -> None:
    stub.enqueue(Reply(text="Sunny.", reasoning="check the sky"), Reply(text="Sunny.", reasoning="check the sky"))
    seen, final = await streamed(client, "openai/stub-model")
    assert seen[:5] == [("start", 0, "thinking"), ("delta", 0, "thinking_delta", "check "),
                        ("delta", 0, "thinking_delta", "the "), ("delta", 0, "thinking_delta", "sky"), ("stop", 0)]
    assert seen[5] == ("start", 1, "text")  # no signature: no provider signed it
    whole = await waited(client, "openai/stub-model")
    assert [block.model_dump() for block in final.content] == [block.model_dump() for block in whole.content]
    assert final.content[0].model_dump() == {"type": "thinking", "thinking": "check the sky", "signature": ""}
