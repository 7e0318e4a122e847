"""`max_tool_calls` through the Responses door with the official `openai` SDK: a model that asks
for more calls than the limit has its first calls kept (returned, streamed, stored and replayed)
and the others dropped, noted as `tool_calls_dropped` in the stored outcome; a limit of 0 leaves
the model's text alone. A limit that is no whole number of 0 or more is refused with
`validation_error` and writes nothing."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from ksi_daemon.context import EventContext
from tests.conftest import HttpDaemon
from tests.stored import stored_response
from tests.stub_openai import Reply, StubOpenAI

pytestmark = pytest.mark.backends

WEATHER: Any = {"type": "function", "name": "weather", "description": "the weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CITIES = ("Oslo", "Bergen", "Tromso")


def three_calls() -> Reply:
    return Reply(text="Looking.", calls=[{"id": f"call_{n}", "name": "weather", "arguments": {"city": city}}
                                         for n, city in enumerate(CITIES)])


async def outcome(http: HttpDaemon, response_id: str) -> dict[str, Any]:
    lines = await stored_response(http.daemon, response_id.removeprefix("resp_"))
    assert lines is not None
    return lines[-1]


async def test_calls_past_the_limit_are_dropped_and_the_kept_ones_replayed(
        http: HttpDaemon, api: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    stub.enqueue(three_calls(), "Sunny in both.")
    first = await api.responses.create(model="openai/stub-model", input="Weather in three cities?", tools=[WEATHER],
                                       max_tool_calls=2)
    calls = [item for item in first.output if item.type == "function_call"]
    assert [call.call_id for call in calls] == ["call_0", "call_1"]
    assert first.max_tool_calls == 2
    stored = await outcome(http, first.id)
    assert stored["tool_calls_dropped"] == 1
    assert [item["call_id"] for item in stored["output"] if item["type"] == "function_call"] == ["call_0", "call_1"]
    answer = await api.responses.create(
        model="openai/stub-model", previous_response_id=first.id, tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"} for call in calls])
    assert answer.output_text == "Sunny in both."
    sent = stub.messages()
    assert [call["id"] for call in sent[1]["tool_calls"]] == ["call_0", "call_1"]
    assert [m["tool_call_id"] for m in sent[2:]] == ["call_0", "call_1"]


async def test_a_stream_shows_only_the_kept_calls(http: HttpDaemon, api: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    stub.enqueue(three_calls())
    stream = await api.responses.create(model="openai/stub-model", input="Weather in three cities?", tools=[WEATHER],
                                        max_tool_calls=1, stream=True)
    added = []
    async for event in stream:
        if event.type == "response.output_item.added" and event.item.type == "function_call":
            added.append(event.item.call_id)
        if event.type == "response.completed":
            done = event.response
    assert added == ["call_0"]
    assert [item.call_id for item in done.output if item.type == "function_call"] == ["call_0"]


async def test_a_limit_of_none_leaves_the_text_alone(http: HttpDaemon, api: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    stub.enqueue(three_calls())
    reply = await api.responses.create(model="openai/stub-model", input="Weather in three cities?", tools=[WEATHER],
                                       max_tool_calls=0)
    assert [item.type for item in reply.output] == ["message"] and reply.output_text == "Looking."
    assert (await outcome(http, reply.id))["tool_calls_dropped"] == 3


@pytest.mark.parametrize("limit", [-1, "2", True, 1.5])
async def test_a_bad_limit_is_refused_and_writes_nothing(
        http: HttpDaemon, api: openai.AsyncOpenAI, stub: StubOpenAI, limit: Any) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        await api.responses.create(model="openai/stub-model", input="hi", tools=[WEATHER],
                                   extra_body={"max_tool_calls": limit})
    assert refused.value.code == "validation_error" and refused.value.param == "max_tool_calls"
    listed = await http.daemon.router.request("conversation:list", {}, EventContext.root())
    assert listed["conversations"] == [] and stub.requests == []
