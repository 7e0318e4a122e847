"""Streamed Messages with the official `anthropic` SDK: Anthropic's SSE events in the order its
accumulator expects (message_start, ping, a start/delta/stop per block with text_delta or
input_json_delta, message_delta with the stop reason and usage, message_stop), the final message
it builds from them, and the streamed turn kept in the same conversation."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anthropic
import pytest

from tests.conftest import HttpDaemon
from tests.stub_openai import Reply, StubOpenAI
from tests.test_http_messages import MODEL, conversations, sdk
from tests.test_http_messages_tools import WEATHER, call


@pytest.fixture
async def client(http_daemon: HttpDaemon) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with sdk(http_daemon) as api:
        yield api


async def test_a_streamed_text_answer(client: anthropic.AsyncAnthropic, stub: StubOpenAI) -> None:
    stub.enqueue("one two three")
    kinds: list[str] = []
    texts: list[str] = []
    async with client.messages.stream(model=MODEL, max_tokens=50,
                                      messages=[{"role": "user", "content": "count"}]) as stream:
        async for event in stream:
            kinds.append(event.type)
            if event.type == "text":
                texts.append(event.text)
        final = await stream.get_final_message()
    assert stub.requests[-1]["stream"] is True
    assert "".join(texts) == "one two three" and len(texts) > 1  # in pieces, as the provider sent them
    assert final.content[0].type == "text" and final.content[0].text == "one two three"
    assert final.stop_reason == "end_turn" and final.usage.output_tokens > 0
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]


async def test_a_streamed_tool_call_then_its_result(
        http_daemon: HttpDaemon, client: anthropic.AsyncAnthropic, stub: StubOpenAI) -> None:
    stub.enqueue(Reply(text="Let me look.", calls=[call("weather", "Oslo", "toolu_s")]))
    ask: Any = {"role": "user", "content": "Weather in Oslo?"}
    partial: list[str] = []
    async with client.messages.stream(model=MODEL, max_tokens=50, tools=[WEATHER], messages=[ask]) as stream:
        async for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                partial.append(event.delta.partial_json)
        final = await stream.get_final_message()
    assert partial and "".join(partial) == '{"city": "Oslo"}'
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[0].text == "Let me look."  # type: ignore[union-attr]
    assert (final.content[1].id, final.content[1].name, final.content[1].input) == (  # type: ignore[union-attr]
        "toolu_s", "weather", {"city": "Oslo"})
    assert final.stop_reason == "tool_use"
    stub.enqueue("12C in Oslo.")
    resent: Any = [ask, {"role": "assistant", "content": [b.model_dump() for b in final.content]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_s", "content": "12C"}]}]
    async with client.messages.stream(model=MODEL, max_tokens=50, tools=[WEATHER], messages=resent) as stream:
        answer = await stream.get_final_message()
    assert answer.content[0].text == "12C in Oslo."  # type: ignore[union-attr]
    assert [m["role"] for m in stub.messages()] == ["user", "assistant", "tool"]
    assert stub.messages()[1]["content"] == "Let me look."
    assert list((await conversations(http_daemon)).values()) == [2]


async def test_raw_events_of_a_tool_call(http_daemon: HttpDaemon, stub: StubOpenAI) -> None:
    """Each block's index, its start before its deltas and its stop after them, one block at a time."""
    stub.enqueue(Reply(calls=[call("weather", "Oslo", "toolu_a"), call("weather", "Lima", "toolu_b")]))
    async with sdk(http_daemon) as api:
        stream = await api.messages.create(model=MODEL, max_tokens=50, tools=[WEATHER], stream=True,
                                           messages=[{"role": "user", "content": "two cities"}])
        events = [event async for event in stream]
    starts = [(e.index, e.content_block.id) for e in events if e.type == "content_block_start"]  # type: ignore[union-attr]
    assert starts == [(0, "toolu_a"), (1, "toolu_b")]
    order = [(e.type, getattr(e, "index", None)) for e in events if e.type.startswith("content_block")]
    assert order[0] == ("content_block_start", 0) and order[-1] == ("content_block_stop", 1)
    assert order.index(("content_block_stop", 0)) < order.index(("content_block_start", 1))
    assert events[-2].type == "message_delta" and events[-2].delta.stop_reason == "tool_use"  # type: ignore[union-attr]


async def test_a_failure_after_the_stream_began_is_an_error_event(
        http_daemon: HttpDaemon, stub: StubOpenAI) -> None:
    stub.enqueue(*[Reply(status=400, body='{"error": {"message": "bad things", "type": "invalid_request_error"}}')]
                 * 3)
    async with sdk(http_daemon) as api:
        stream = await api.messages.create(model=MODEL, max_tokens=50, stream=True,
                                           messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(anthropic.APIStatusError) as failed:
            async for _event in stream:
                pass
    error = (failed.value.body or {})["error"]  # type: ignore[index]
    # the details completion:error carries: the name the wait adds to every failure is left out
    assert error["code"] == "provider_error" and "request_id" not in error.get("details", {})
    assert await conversations(http_daemon) == {}  # a failed turn is never indexed


async def test_a_reasoning_summary_is_a_thinking_block(
        http_daemon: HttpDaemon, client: anthropic.AsyncAnthropic, stub: StubOpenAI) -> None:
    """Waited for or streamed (as thinking_delta); resent by the client, it is left out of matching."""
    stub.enqueue(Reply(text="4", reasoning="two and two"), Reply(text="8", reasoning="doubled"))
    ask: Any = {"role": "user", "content": "2+2?"}
    waited = await client.messages.create(model=MODEL, max_tokens=50, messages=[ask])
    assert [b.type for b in waited.content] == ["thinking", "text"]
    assert waited.content[0].thinking == "two and two"  # type: ignore[union-attr]
    thought: list[str] = []
    resent: Any = [ask, {"role": "assistant", "content": [b.model_dump() for b in waited.content]},
                   {"role": "user", "content": "doubled?"}]
    async with client.messages.stream(model=MODEL, max_tokens=50, messages=resent) as stream:
        async for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "thinking_delta":
                thought.append(event.delta.thinking)
        final = await stream.get_final_message()
    assert "".join(thought) == "doubled"
    # the summary streams as it comes, before the answer: the same blocks as the waited-for reply
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].model_dump() == {"type": "thinking", "thinking": "doubled", "signature": ""}
    assert [m["content"] for m in stub.messages()] == ["2+2?", "4", "doubled?"]  # no reasoning sent back
    assert list((await conversations(http_daemon)).values()) == [2]
