"""Reasoning items through the Responses door with the official `openai` SDK: what a provider
returns as reasoning (litellm's reasoning_content, Anthropic's signed thinking blocks) is kept with
the exchange, returned as a `reasoning` item (with `encrypted_content` when `include` asks), and
replayed only to a provider that can take it back; a provider that returns none gives no item and
no refusal. A provider switch in the middle of a tool loop, with a custom tool translated both ways.
On both storage backends."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.conftest import HttpDaemon, running_http_daemon, stub_settings
from tests.stored import stored_index, stored_response
from tests.stub_openai import Reply, StubOpenAI
from tests.test_http_tool_kinds import APPLY_PATCH, PATCH

pytestmark = pytest.mark.backends

INCLUDE: Any = ["reasoning.encrypted_content"]


@pytest.fixture
async def http(short_tmp: Path, stub: StubOpenAI, backend: dict[str, Any],
               monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[HttpDaemon]:
    monkeypatch.setenv("KSI_TEST_ANTHROPIC_KEY", "sk-ant-stub")
    anthropic = {"api_base": f"http://127.0.0.1:{stub.port}", "api_key_env": "KSI_TEST_ANTHROPIC_KEY"}
    async with running_http_daemon(short_tmp, **stub_settings(stub, models={"anthropic/stub*": anthropic}),
                                   **backend) as running:
        yield running


@pytest.fixture
async def client(http: HttpDaemon) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{http.base_url}/v1", api_key=http.token, max_retries=0) as api:
        yield api


def reasoning_of(response: Any) -> list[Any]:
    return [item for item in response.output if item.type == "reasoning"]


def decoded(item: Any) -> dict[str, Any]:
    return json.loads(base64.b64decode(item.encrypted_content))


async def test_reasoning_is_an_item_with_encrypted_content_only_when_included(
        http: HttpDaemon, client: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    stub.enqueue(Reply(text="42", reasoning="six times seven"))
    asked = await client.responses.create(model="openai/stub-model", input="The answer?", include=INCLUDE,
                                          reasoning={"summary": "auto"})
    [item] = reasoning_of(asked)
    assert [part.text for part in item.summary] == ["six times seven"]
    assert decoded(item) == {"summary": "six times seven"}
    stub.enqueue(Reply(text="43", reasoning="one more"))
    plain = await client.responses.create(model="openai/stub-model", input="And next?", previous_response_id=asked.id)
    [item] = reasoning_of(plain)
    assert item.encrypted_content is None
    # an OpenAI-style provider takes no reasoning back
    assert all(set(message) <= {"role", "content"} for message in stub.messages())
    lines = await stored_response(http.daemon, asked.id.removeprefix("resp_"))
    assert lines is not None and lines[-1]["output"][0] == {"type": "reasoning", "summary": "six times seven"}


@pytest.mark.parametrize("stream", [False, True])
async def test_no_reasoning_no_item_and_no_refusal(client: openai.AsyncOpenAI, stub: StubOpenAI, stream: bool) -> None:
    if stream:
        async with client.responses.stream(model="openai/stub-model", input="hi", include=INCLUDE,
                                           reasoning={"summary": "detailed"}) as events:
            answer = await events.get_final_response()
    else:
        answer = await client.responses.create(model="openai/stub-model", input="hi", include=INCLUDE,
                                               reasoning={"summary": "detailed"})
    assert answer.output_text == "stub answer to: hi" and reasoning_of(answer) == []


@pytest.mark.parametrize("stream", [False, True])
async def test_a_provider_switch_mid_tool_loop_replays_reasoning_only_where_it_can_go(
        http: HttpDaemon, client: openai.AsyncOpenAI, stub: StubOpenAI, stream: bool) -> None:
    async def create(**body: Any) -> Any:
        if not stream:
            return await client.responses.create(tools=[APPLY_PATCH], include=INCLUDE, **body)
        async with client.responses.stream(tools=[APPLY_PATCH], include=INCLUDE, **body) as events:
            return await events.get_final_response()

    stub.enqueue(Reply(thinking=("a patch adds the file", "sig-1"),
                       calls=[{"id": "toolu_1", "name": "apply_patch", "arguments": {"input": PATCH}}]))
    first = await create(model="anthropic/stub-claude", input="add a.txt")
    [reasoned] = reasoning_of(first)
    assert decoded(reasoned)["thinking_blocks"] == [
        {"type": "thinking", "thinking": "a patch adds the file", "signature": "sig-1"}]
    [made] = [item for item in first.output if item.type == "custom_tool_call"]
    assert (made.call_id, made.input) == ("toolu_1", PATCH)

    # the same provider takes its signed thinking back, before the custom call as a tool_use block
    stub.enqueue(Reply(calls=[{"id": "toolu_2", "name": "apply_patch", "arguments": {"input": "*** second"}}]))
    second = await create(model="anthropic/stub-claude", previous_response_id=first.id,
                          input=[{"type": "custom_tool_call_output", "call_id": "toolu_1", "output": "Done"}])
    assistant = stub.anthropic_requests[-1]["messages"][1]
    assert assistant["content"][0] == {"type": "thinking", "thinking": "a patch adds the file", "signature": "sig-1"}
    assert assistant["content"][-1] == {"type": "tool_use", "id": "toolu_1", "name": "apply_patch",
                                        "input": {"input": PATCH}}
    assert stub.anthropic_requests[-1]["messages"][2]["content"][0]["tool_use_id"] == "toolu_1"

    # another provider, mid loop: the calls and outputs, no reasoning
    stub.enqueue(Reply(text="Both patches applied."))
    third = await create(model="openai/stub-model", previous_response_id=second.id,
                         input=[{"type": "custom_tool_call_output", "call_id": "toolu_2", "output": "Done again"}])
    assert third.output_text == "Both patches applied."
    sent = stub.messages()
    assert not any("thinking_blocks" in message or "reasoning_content" in message for message in sent)
    calls = [call for message in sent for call in message.get("tool_calls") or []]
    assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("toolu_1", "apply_patch", {"input": PATCH}), ("toolu_2", "apply_patch", {"input": "*** second"})]
    assert [(m["tool_call_id"], m["content"]) for m in sent if m["role"] == "tool"] == [
        ("toolu_1", "Done"), ("toolu_2", "Done again")]
    conversations = {r.conversation.id for r in (first, second, third)}
    assert len(conversations) == 1
    assert len(await stored_index(http.daemon, conversations.pop())) == 3


async def test_a_streamed_function_call_after_thinking_is_one_item(
        client: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    stub.enqueue(Reply(thinking=("look it up", "sig-9"), text="Looking.",
                       calls=[{"id": "toolu_w", "name": "weather", "arguments": {"city": "Oslo"}}]))
    weather: Any = {"type": "function", "name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    async with client.responses.stream(model="anthropic/stub-claude", input="Oslo?", tools=[weather]) as events:
        answer = await events.get_final_response()
    assert sorted(item.type for item in answer.output) == ["function_call", "message", "reasoning"]
    [made] = [item for item in answer.output if item.type == "function_call"]
    assert (made.call_id, json.loads(made.arguments)) == ("toolu_w", {"city": "Oslo"})


async def test_a_streamed_summary_comes_first_in_pieces_as_the_waited_for_one(
        client: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    stub.enqueue(Reply(text="42", reasoning="six times seven"), Reply(text="42", reasoning="six times seven"))
    seen: list[tuple[Any, ...]] = []
    async with client.responses.stream(model="openai/stub-model", input="6*7?") as events:
        async for event in events:
            if event.type.startswith(("response.reasoning_summary", "response.output_text.delta",
                                      "response.output_item.added")):
                seen.append((event.type, event.output_index, getattr(event, "delta", None)))
        final = await events.get_final_response()
    assert seen == [("response.output_item.added", 0, None), ("response.reasoning_summary_part.added", 0, None),
                    ("response.reasoning_summary_text.delta", 0, "six "),
                    ("response.reasoning_summary_text.delta", 0, "times "),
                    ("response.reasoning_summary_text.delta", 0, "seven"),
                    ("response.output_item.added", 1, None), ("response.output_text.delta", 1, "42"),
                    ("response.reasoning_summary_text.done", 0, None), ("response.reasoning_summary_part.done", 0, None)]
    waited = await client.responses.create(model="openai/stub-model", input="6*7?")
    assert [(item.type, item.id.split("_")[0]) for item in final.output] == [("reasoning", "rs"), ("message", "msg")]
    assert final.output[0].summary == waited.output[0].summary  # type: ignore[union-attr]
    assert final.output_text == waited.output_text == "42"
