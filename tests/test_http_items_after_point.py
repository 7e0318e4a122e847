"""Input items after a stored point, through the Responses door with the official `openai` SDK:
with `previous_response_id` or `conversation`, items of any type (messages, function calls and
their outputs, reasoning) follow that point's context, as OpenAI takes them. A client stepping
through a tool loop with a fixed `previous_response_id` resends its own call and the call's
output at each step: KSI continues the exchange it holds, so the loop stays ONE conversation
holding each item once. Items the conversation does not hold are added as exchanges; a bad one
is refused with its code and nothing is written."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from ksi_daemon.context import EventContext
from tests.conftest import HttpDaemon
from tests.stub_openai import Reply, StubOpenAI
from tests.test_http_openai import ksi_id

pytestmark = pytest.mark.backends

WEATHER: Any = {"type": "function", "name": "weather", "description": "the weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


async def request(http: HttpDaemon, event: str, data: dict[str, Any]) -> dict[str, Any]:
    return await http.daemon.router.request(event, data, EventContext.root())


async def conversations(http: HttpDaemon) -> list[dict[str, Any]]:
    return list((await request(http, "conversation:list", {}))["conversations"])


def sent(stub: StubOpenAI) -> list[tuple[Any, ...]]:
    """What the provider was sent last: roles with their text, calls and call outputs."""
    shown: list[tuple[Any, ...]] = []
    for message in stub.messages():
        if message.get("tool_calls"):
            shown.append(("call", *[c["id"] for c in message["tool_calls"]]))
        elif message["role"] == "tool":
            shown.append(("output", message["tool_call_id"], message["content"]))
        else:
            shown.append((message["role"], message["content"]))
    return shown


async def opening(api: openai.AsyncOpenAI, stub: StubOpenAI) -> str:
    stub.enqueue("Hello.")
    return (await api.responses.create(model="openai/stub-model", input="Hi")).id


def call_item(call_id: str, city: str) -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": "weather", "arguments": json.dumps({"city": city})}


def output_item(call_id: str, output: str) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": output}


async def test_a_tool_loop_stepping_with_one_previous_response_id_is_one_conversation(
        http: HttpDaemon, api: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    first = await opening(api, stub)
    question = {"role": "user", "content": "Weather in Oslo?"}
    stub.enqueue(Reply(calls=[{"id": "call_1", "name": "weather", "arguments": {"city": "Oslo"}}]), "It is 12C.")
    step = await api.responses.create(model="openai/stub-model", previous_response_id=first, input=[question],
                                      tools=[WEATHER])
    [call] = step.output
    assert call.type == "function_call" and call.call_id == "call_1"
    # the next step resends its own turn (the question, the call) and the call's output, after the same point
    done = await api.responses.create(model="openai/stub-model", previous_response_id=first, tools=[WEATHER],
                                      input=[question, call_item("call_1", "Oslo"), output_item("call_1", "12C")])
    assert done.output_text == "It is 12C."
    assert sent(stub) == [("user", "Hi"), ("assistant", "Hello."), ("user", "Weather in Oslo?"), ("call", "call_1"),
                          ("output", "call_1", "12C")]
    [conversation] = await conversations(http)
    assert conversation["exchanges"] == 3  # each item once: no exchange stored twice, no fork
    shown = await request(http, "response:show", {"response_id": ksi_id(done.id)})
    assert shown["previous_response_id"] == ksi_id(step.id)


async def test_the_call_of_the_previous_response_resent_before_its_output_is_that_responses(
        http: HttpDaemon, api: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    stub.enqueue(Reply(calls=[{"id": "call_1", "name": "weather", "arguments": {"city": "Oslo"}}]), "It is 12C.")
    step = await api.responses.create(model="openai/stub-model", input="Weather in Oslo?", tools=[WEATHER])
    done = await api.responses.create(model="openai/stub-model", previous_response_id=step.id, tools=[WEATHER],
                                      input=[call_item("call_1", "Oslo"), output_item("call_1", "12C")])
    assert done.output_text == "It is 12C."
    assert sent(stub) == [("user", "Weather in Oslo?"), ("call", "call_1"), ("output", "call_1", "12C")]
    [conversation] = await conversations(http)
    assert conversation["exchanges"] == 2


async def test_items_the_conversation_does_not_hold_are_added_after_it(
        http: HttpDaemon, api: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    first = await opening(api, stub)
    [conversation] = await conversations(http)
    stub.enqueue("Oslo is mild today.")
    done = await api.responses.create(
        model="openai/stub-model", conversation=conversation["conversation_id"], tools=[WEATHER], input=[
            {"role": "user", "content": "Weather in Oslo?"}, {"type": "reasoning", "id": "rs_1", "summary": []},
            call_item("call_9", "Oslo"), output_item("call_9", "12C")])
    assert done.output_text == "Oslo is mild today."
    assert sent(stub) == [("user", "Hi"), ("assistant", "Hello."), ("user", "Weather in Oslo?"), ("call", "call_9"),
                          ("output", "call_9", "12C")]
    [after] = await conversations(http)
    assert after["exchanges"] == 3  # the client's turn added as an exchange, then the answered one
    # an older point: the items go into a fork there, the conversation stays as it was
    stub.enqueue("Bergen is wet.")
    await api.responses.create(model="openai/stub-model", previous_response_id=first, tools=[WEATHER], input=[
        {"role": "user", "content": "And Bergen?"}, call_item("call_8", "Bergen"), output_item("call_8", "rain")])
    assert sent(stub) == [("user", "Hi"), ("assistant", "Hello."), ("user", "And Bergen?"), ("call", "call_8"),
                          ("output", "call_8", "rain")]
    listed = {c["conversation_id"]: c["exchanges"] for c in await conversations(http)}
    assert listed[conversation["conversation_id"]] == 3 and len(listed) == 2


@pytest.mark.parametrize("items, field", [
    ([call_item("call_1", "Oslo"), output_item("call_1", "12C")], "input.0"),  # no such call before it
    ([{"role": "user", "content": "Weather?"}, call_item("call_1", "Oslo"), output_item("call_2", "12C")], "input"),
    ([{"role": "user", "content": "Weather?"}, call_item("call_1", "Oslo"), {"role": "user", "content": "well?"}],
     "input"),
])
async def test_bad_items_after_a_point_are_refused_and_nothing_is_written(
        http: HttpDaemon, api: openai.AsyncOpenAI, stub: StubOpenAI, items: list[dict[str, Any]], field: str) -> None:
    first = await opening(api, stub)
    before = len(stub.requests)
    with pytest.raises(openai.BadRequestError) as refused:
        await api.responses.create(model="openai/stub-model", previous_response_id=first, tools=[WEATHER],
                                   input=items)  # type: ignore[arg-type]
    error = refused.value.body
    assert isinstance(error, dict) and error["code"] == "validation_error" and error["param"] == field
    [conversation] = await conversations(http)
    assert conversation["exchanges"] == 1 and len(stub.requests) == before


async def test_an_unknown_previous_response_with_items_is_previous_response_not_found(
        http: HttpDaemon, api: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as refused:
        await api.responses.create(model="openai/stub-model", previous_response_id="resp_nothing-0123456789ab",
                                   input=[{"role": "user", "content": "Weather?"}, call_item("call_1", "Oslo"),
                                          output_item("call_1", "12C")])
    assert isinstance(refused.value.body, dict) and refused.value.body["code"] == "previous_response_not_found"
    assert await conversations(http) == []
