"""Tool loops through the OpenAI-compatible door with the official `openai` SDK: the stub (through
real litellm) calls tools, the client runs them and sends their outputs back, the stub sees them
and answers; streamed as the SDK's own accumulators expect, and kept as one KSI conversation."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

from ksi_common.errors import ErrorCode
from ksi_common.jsonl import read_records
from ksi_daemon.context import EventContext
from tests.conftest import HttpDaemon, running_http_daemon, stub_settings
from tests.stub_openai import Reply, StubOpenAI
from tests.test_request_options import SCHEMA, stored

WEATHER: Any = {"type": "function", "name": "weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CLOCK: Any = {"type": "function", "name": "clock", "description": "the time in a city",
         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


class City(BaseModel):
    city: str


def nested(tool: dict[str, Any]) -> Any:
    """A flat (Responses) function tool in the Chat Completions form."""
    return {"type": "function", "function": {key: value for key, value in tool.items() if key != "type"}}


def sdk(http: HttpDaemon) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{http.base_url}/v1", api_key=http.token, max_retries=0)


@pytest.fixture
async def client(http_daemon: HttpDaemon) -> AsyncIterator[openai.AsyncOpenAI]:
    async with sdk(http_daemon) as api:
        yield api


def exchanges(http: HttpDaemon, conversation_id: str) -> int:
    return len(read_records(http.daemon.layout.index_file(conversation_id)))


def tool_turns(stub: StubOpenAI, index: int = -1) -> list[tuple[Any, ...]]:
    """What the stub was sent, tool calls and tool results included."""
    turns: list[tuple[Any, ...]] = []
    for message in stub.messages(index):
        if message.get("tool_calls"):
            turns.append(("assistant", [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
                                        for c in message["tool_calls"]]))
        elif message["role"] == "tool":
            turns.append(("tool", message["tool_call_id"], message["content"]))
        else:
            turns.append((message["role"], message["content"]))
    return turns


def call(name: str, city: str, call_id: str) -> dict[str, Any]:
    return {"id": call_id, "name": name, "arguments": {"city": city}}


# -- Chat Completions -------------------------------------------------------------------------------

async def test_chat_tool_loop_by_conversation_id(
        http_daemon: HttpDaemon, client: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    stub.enqueue(Reply(calls=[call("weather", "Oslo", "call_w1")]))
    first = await client.chat.completions.create(
        model="openai/stub-model", messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[nested(WEATHER)], tool_choice="auto")
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls is not None
    [made] = choice.message.tool_calls
    assert made.type == "function" and made.id == "call_w1"
    assert (made.function.name, json.loads(made.function.arguments)) == ("weather", {"city": "Oslo"})
    assert stub.requests[-1]["tools"] == [nested(WEATHER)]
    assert stub.requests[-1]["tool_choice"] == "auto"
    conversation_id = (first.model_extra or {})["conversation_id"]

    final = await client.chat.completions.create(
        model="openai/stub-model", tools=[nested(WEATHER)],
        messages=[{"role": "tool", "tool_call_id": "call_w1", "content": "12C and rain"}],
        extra_body={"conversation_id": conversation_id})
    assert final.choices[0].finish_reason == "stop" and final.choices[0].message.tool_calls is None
    assert final.choices[0].message.content == "stub answer to: Weather in Oslo?"
    assert tool_turns(stub) == [("user", "Weather in Oslo?"),
                                ("assistant", [("call_w1", "weather", {"city": "Oslo"})]),
                                ("tool", "call_w1", "12C and rain")]
    assert (final.model_extra or {})["conversation_id"] == conversation_id
    assert exchanges(http_daemon, conversation_id) == 2


async def test_chat_parallel_calls_streamed_as_the_sdk_accumulates_them(
        http_daemon: HttpDaemon, client: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    stub.enqueue(Reply(calls=[call("weather", "Oslo", "call_a"), call("clock", "Lima", "call_b")]))
    # the stream helper parses the arguments of strict tools made from pydantic models
    tools = [openai.pydantic_function_tool(City, name="weather"), openai.pydantic_function_tool(City, name="clock")]
    async with client.chat.completions.stream(
            model="openai/stub-model", messages=[{"role": "user", "content": "Oslo weather, Lima time"}],
            tools=tools, parallel_tool_calls=True) as stream:
        first = await stream.get_final_completion()
    assert stub.requests[-1]["stream"] is True and stub.requests[-1]["parallel_tool_calls"] is True
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls is not None
    assert [(c.id, c.function.name, c.function.parsed_arguments) for c in choice.message.tool_calls] == [
        ("call_a", "weather", City(city="Oslo")), ("call_b", "clock", City(city="Lima"))]
    conversation_id = (first.model_extra or {})["conversation_id"]

    pieces: list[str] = []
    stream_two = await client.chat.completions.create(
        model="openai/stub-model", tools=tools, stream=True,
        messages=[{"role": "tool", "tool_call_id": "call_a", "content": "12C"},
                  {"role": "tool", "tool_call_id": "call_b", "content": "09:30"}],
        extra_body={"conversation_id": conversation_id})
    async for chunk in stream_two:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        assert not (chunk.choices and chunk.choices[0].delta.tool_calls)
    assert "".join(pieces) == "stub answer to: Oslo weather, Lima time"
    assert tool_turns(stub)[1:] == [
        ("assistant", [("call_a", "weather", {"city": "Oslo"}), ("call_b", "clock", {"city": "Lima"})]),
        ("tool", "call_a", "12C"), ("tool", "call_b", "09:30")]
    assert exchanges(http_daemon, conversation_id) == 2


async def test_chat_stream_of_calls_in_raw_chunks(
        http_daemon: HttpDaemon, client: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    """Each call's id, type and name come once, its arguments in pieces, then finish_reason tool_calls."""
    stub.enqueue(Reply(calls=[call("weather", "Oslo", "call_a"), call("clock", "Lima", "call_b")]))
    deltas = []
    finish = None
    stream = await client.chat.completions.create(
        model="openai/stub-model", messages=[{"role": "user", "content": "both"}], stream=True,
        tools=[nested(WEATHER), nested(CLOCK)])
    async for chunk in stream:
        for choice in chunk.choices:
            deltas += [delta.model_dump(exclude_none=True) for delta in choice.delta.tool_calls or []]
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    named = [delta for delta in deltas if "id" in delta]
    assert [(d["index"], d["id"], d["type"], d["function"]["name"]) for d in named] == [
        (0, "call_a", "function", "weather"), (1, "call_b", "function", "clock")]
    for index, city in ((0, "Oslo"), (1, "Lima")):
        arguments = "".join(d["function"].get("arguments", "") for d in deltas if d["index"] == index)
        assert json.loads(arguments) == {"city": city}
    assert len(deltas) > len(named)  # the arguments came in pieces


async def test_chat_tool_loop_with_the_clients_own_history(
        http_daemon: HttpDaemon, client: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    """The loop as the SDK's own docs write it: the whole message list each time, no KSI id. The
    earlier turns are imported with their calls; the trailing tool messages are the new input."""
    stub.enqueue(Reply(calls=[call("weather", "Oslo", "call_w1"), call("clock", "Oslo", "call_c1")]))
    messages: list[Any] = [{"role": "system", "content": "Use the tools."},
                           {"role": "user", "content": "Weather and time in Oslo?"}]
    tools: Any = [nested(WEATHER), nested(CLOCK)]
    first = await client.chat.completions.create(model="openai/stub-model", messages=messages, tools=tools)
    asked = first.choices[0].message
    messages.append(asked)
    for made in asked.tool_calls or []:
        messages.append({"role": "tool", "tool_call_id": made.id, "content": f"{made.function.name}: fine"})
    final = await client.chat.completions.create(model="openai/stub-model", messages=messages, tools=tools)
    assert final.choices[0].message.content == "stub answer to: Weather and time in Oslo?"
    assert tool_turns(stub) == [
        ("system", "Use the tools."), ("user", "Weather and time in Oslo?"),
        ("assistant", [("call_w1", "weather", {"city": "Oslo"}), ("call_c1", "clock", {"city": "Oslo"})]),
        ("tool", "call_w1", "weather: fine"), ("tool", "call_c1", "clock: fine")]
    conversation_id = (final.model_extra or {})["conversation_id"]
    shown = await http_daemon.daemon.router.request("conversation:show", {"conversation_id": conversation_id},
                                                    EventContext.root())
    assert [[item["type"] for item in exchange["output"]] for exchange in shown["exchanges"]] == [
        ["function_call", "function_call"], ["message"]]
    assert [item["call_id"] for item in shown["exchanges"][1]["input"]] == ["call_w1", "call_c1"]


async def test_chat_tool_messages_answer_every_call_of_the_assistant_message_before_them(
        http_daemon: HttpDaemon, stub: StubOpenAI) -> None:
    async with httpx.AsyncClient(base_url=http_daemon.base_url,
                                 headers={"Authorization": f"Bearer {http_daemon.token}"}) as http:
        made = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
        reply = await http.post("/v1/chat/completions", json={"model": "openai/stub-model", "messages": [
            {"role": "user", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": [made]},
            {"role": "tool", "tool_call_id": "call_2", "content": "42"}]})
        missing = await http.post("/v1/chat/completions", json={"model": "openai/stub-model", "messages": [
            {"role": "user", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": [made]},
            {"role": "tool", "content": "42"}]})
        second = {"id": "call_2", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
        unanswered = await http.post("/v1/chat/completions", json={"model": "openai/stub-model", "messages": [
            {"role": "user", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": [made, second]},
            {"role": "tool", "tool_call_id": "call_1", "content": "42"}, {"role": "user", "content": "and?"}]})
    assert (reply.status_code, reply.json()["error"]["code"], reply.json()["error"]["param"]) == (
        400, ErrorCode.VALIDATION_ERROR, "messages.2.tool_call_id")
    assert (missing.status_code, missing.json()["error"]["code"], missing.json()["error"]["param"]) == (
        400, ErrorCode.VALIDATION_ERROR, "messages.2.tool_call_id")
    assert (unanswered.status_code, unanswered.json()["error"]["code"], unanswered.json()["error"]["param"]) == (
        400, ErrorCode.VALIDATION_ERROR, "messages.3")
    assert "call_2" in unanswered.json()["error"]["message"]
    assert stored(http_daemon.daemon) == [] and stub.requests == []


# -- Responses --------------------------------------------------------------------------------------

async def test_responses_tool_loop_by_previous_response_id(
        http_daemon: HttpDaemon, client: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    stub.enqueue(Reply(calls=[call("weather", "Oslo", "call_w1")]))
    first = await client.responses.create(model="openai/stub-model", input="Weather in Oslo?",
                                          tools=[WEATHER], tool_choice="required")
    assert stub.requests[-1]["tools"] == [nested(WEATHER)] and stub.requests[-1]["tool_choice"] == "required"
    [made] = first.output
    assert made.type == "function_call" and made.status == "completed"
    assert (made.call_id, made.name, json.loads(made.arguments)) == ("call_w1", "weather", {"city": "Oslo"})
    assert first.output_text == "" and first.tool_choice == "required"
    assert [tool.name for tool in first.tools] == ["weather"]  # type: ignore[union-attr]

    second = await client.responses.create(
        model="openai/stub-model", previous_response_id=first.id, tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": "call_w1", "output": "12C and rain"}])
    assert second.output_text == "stub answer to: Weather in Oslo?"
    assert tool_turns(stub) == [("user", "Weather in Oslo?"),
                                ("assistant", [("call_w1", "weather", {"city": "Oslo"})]),
                                ("tool", "call_w1", "12C and rain")]
    assert first.conversation and second.conversation and second.conversation.id == first.conversation.id
    assert exchanges(http_daemon, first.conversation.id) == 2

    kept = await client.responses.retrieve(first.id)
    assert [(item.type, item.call_id) for item in kept.output] == [  # type: ignore[union-attr]
        ("function_call", "call_w1")]
    inputs = await client.responses.input_items.list(second.id)
    assert [(item.type, item.call_id, item.output) for item in inputs.data] == [  # type: ignore[union-attr]
        ("function_call_output", "call_w1", "12C and rain")]


async def test_responses_tool_loop_in_a_conversation(
        http_daemon: HttpDaemon, client: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    stub.enqueue(Reply(calls=[call("weather", "Oslo", "call_w1")]))
    conversation = await client.conversations.create()
    asked = await client.responses.create(model="openai/stub-model", input="Weather in Oslo?",
                                          conversation=conversation.id, tools=[WEATHER])
    assert [item.type for item in asked.output] == ["function_call"]
    answered = await client.responses.create(
        model="openai/stub-model", conversation=conversation.id, tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": "call_w1", "output": "12C"}])
    assert answered.output_text == "stub answer to: Weather in Oslo?"
    assert tool_turns(stub)[-2:] == [("assistant", [("call_w1", "weather", {"city": "Oslo"})]),
                                     ("tool", "call_w1", "12C")]
    assert exchanges(http_daemon, conversation.id) == 2


async def test_a_conversations_items_list_a_tool_exchange_as_its_items(
        http_daemon: HttpDaemon, client: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    stub.enqueue(Reply(calls=[call("weather", "Oslo", "call_w1")]))
    asked = await client.responses.create(model="openai/stub-model", input="Weather in Oslo?", tools=[WEATHER])
    await client.responses.create(model="openai/stub-model", previous_response_id=asked.id, tools=[WEATHER],
                                  input=[{"type": "function_call_output", "call_id": "call_w1", "output": "12C"}])
    assert asked.conversation is not None
    listed = await client.conversations.items.list(asked.conversation.id, order="asc")
    assert [(item.type, item.model_dump().get("call_id")) for item in listed.data] == [
        ("message", None), ("function_call", "call_w1"), ("function_call_output", "call_w1"), ("message", None)]


async def test_responses_parallel_calls_streamed_in_the_sdks_order(
        http_daemon: HttpDaemon, client: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    stub.enqueue(Reply(calls=[call("weather", "Oslo", "call_a"), call("clock", "Lima", "call_b")]))
    events: list[Any] = []
    async with client.responses.stream(model="openai/stub-model", input="Oslo weather, Lima time",
                                       tools=[WEATHER, CLOCK]) as stream:
        async for event in stream:
            events.append(event)
        first = await stream.get_final_response()
    kinds = [event.type for event in events]
    per_call = ["response.output_item.added", "response.function_call_arguments.delta",
                "response.function_call_arguments.delta"]
    assert kinds == ["response.created", "response.in_progress", *per_call, *per_call,
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    events_schema: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
    for event in events:  # each item event as the SDK's own types define it (the Response object: elsewhere)
        if event.type not in ("response.created", "response.in_progress", "response.completed"):
            events_schema.validate_python(event.model_dump(exclude_unset=True))
    done = [event for event in events if event.type == "response.function_call_arguments.done"]
    assert [(e.output_index, e.name, json.loads(e.arguments)) for e in done] == [
        (0, "weather", {"city": "Oslo"}), (1, "clock", {"city": "Lima"})]
    assert [(item.type, item.call_id, item.name) for item in first.output] == [  # type: ignore[union-attr]
        ("function_call", "call_a", "weather"), ("function_call", "call_b", "clock")]
    assert json.loads(first.output[1].arguments) == {"city": "Lima"}  # type: ignore[union-attr]

    answered = [{"type": "function_call_output", "call_id": "call_a", "output": "12C"},
                {"type": "function_call_output", "call_id": "call_b", "output": "09:30"}]
    async with client.responses.stream(model="openai/stub-model", input=answered,
                                       previous_response_id=first.id, tools=[WEATHER, CLOCK]) as stream:
        final = await stream.get_final_response()
    assert final.output_text == "stub answer to: Oslo weather, Lima time"
    assert tool_turns(stub)[1:] == [
        ("assistant", [("call_a", "weather", {"city": "Oslo"}), ("call_b", "clock", {"city": "Lima"})]),
        ("tool", "call_a", "12C"), ("tool", "call_b", "09:30")]
    assert first.conversation and final.conversation and final.conversation.id == first.conversation.id


async def test_the_readme_tool_loop(http_daemon: HttpDaemon, stub: StubOpenAI) -> None:
    """The tool loop of docs/http.md, with the blocking client: two rounds of calls, then the answer."""
    stub.enqueue(Reply(calls=[call("weather", "Oslo", "c1")]),
                 Reply(calls=[call("weather", "Lima", "c2"), call("weather", "Rome", "c3")]), "done")

    def weather(city: str) -> str:
        return f"12C in {city}"

    def loop() -> str:
        with openai.OpenAI(base_url=f"{http_daemon.base_url}/v1", api_key=http_daemon.token, max_retries=0) as api:
            response = api.responses.create(model="openai/stub-model", input="Weather in Oslo?",
                                            tools=[WEATHER])
            while calls := [item for item in response.output if item.type == "function_call"]:
                outputs: Any = [{"type": "function_call_output", "call_id": made.call_id,
                                 "output": weather(**json.loads(made.arguments))} for made in calls]
                response = api.responses.create(input=outputs, previous_response_id=response.id,
                                                tools=[WEATHER])
            return response.output_text

    assert await asyncio.to_thread(loop) == "done"  # the server runs on this loop: the client beside it
    assert tool_turns(stub)[1:] == [
        ("assistant", [("c1", "weather", {"city": "Oslo"})]), ("tool", "c1", "12C in Oslo"),
        ("assistant", [("c2", "weather", {"city": "Lima"}), ("c3", "weather", {"city": "Rome"})]),
        ("tool", "c2", "12C in Lima"), ("tool", "c3", "12C in Rome")]


async def test_a_reasoning_summary_is_an_output_item(
        http_daemon: HttpDaemon, client: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    stub.enqueue(Reply(text="42", reasoning="six times seven"))
    answer = await client.responses.create(model="openai/stub-model", input="The answer?")
    retrieved = await client.responses.retrieve(answer.id)
    for shown in (answer, retrieved):
        summaries = [item for item in shown.output if item.type == "reasoning"]
        assert [part.text for item in summaries for part in item.summary] == ["six times seven"]
        assert shown.output_text == "42"


async def test_a_json_schema_text_format_reaches_the_stub_beside_tools(
        http_daemon: HttpDaemon, client: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    stub.enqueue('{"city": "Oslo"}')
    answer = await client.responses.create(
        model="openai/stub-model", input="Which city?", tools=[WEATHER],
        text={"format": {"type": "json_schema", "name": "place", "schema": SCHEMA, "strict": True}})
    assert json.loads(answer.output_text) == {"city": "Oslo"}
    sent = stub.requests[-1]
    assert sent["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}
    assert sent["tools"] == [nested(WEATHER)]


# -- refusals ---------------------------------------------------------------------------------------

async def test_tools_to_a_model_without_tool_support_are_refused_and_nothing_is_written(
        short_tmp: Path, stub: StubOpenAI) -> None:
    settings = stub_settings(stub, models={"openai/stub-plain": {"api_base": stub.api_base,
                                                                 "supports_function_calling": False}})
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    async with running_http_daemon(short_tmp, **settings) as http, sdk(http) as client:
        with pytest.raises(openai.BadRequestError) as responses:
            await client.responses.create(model="openai/stub-plain", input="hi", tools=[WEATHER])
        for earlier in ([], history):  # with a history of its own, refused before it is imported
            with pytest.raises(openai.BadRequestError) as chat:
                await client.chat.completions.create(
                    model="openai/stub-plain", messages=[*earlier, {"role": "user", "content": "hi"}],
                    tools=[nested(WEATHER)])
            assert chat.value.code == ErrorCode.UNSUPPORTED_PARAMETER
            assert isinstance(chat.value.body, dict) and chat.value.body["param"] == "tools"
        assert responses.value.code == ErrorCode.UNSUPPORTED_PARAMETER
        assert isinstance(responses.value.body, dict) and responses.value.body["param"] == "tools"
        assert stored(http.daemon) == [] and stub.requests == []
        # the defaults clients send with no tools still pass
        plain = await client.chat.completions.create(
            model="openai/stub-plain", messages=[{"role": "user", "content": "hi"}], tools=[], tool_choice="auto")
        assert plain.choices[0].message.content == "stub answer to: hi"


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice.type"),
    ({"input": [{"type": "computer_call_output", "call_id": "c", "output": {}}]}, "input.0.type"),
])
async def test_hosted_tools_are_refused_by_name(http_daemon: HttpDaemon, stub: StubOpenAI, body: dict[str, Any],
                                                param: str) -> None:
    async with httpx.AsyncClient(base_url=http_daemon.base_url,
                                 headers={"Authorization": f"Bearer {http_daemon.token}"}) as http:
        reply = await http.post("/v1/responses", json={"model": "openai/stub-model", **body})
    assert reply.status_code == 400
    assert (reply.json()["error"]["code"], reply.json()["error"]["param"]) == (ErrorCode.UNSUPPORTED_PARAMETER, param)
    assert stored(http_daemon.daemon) == [] and stub.requests == []


async def test_a_call_in_the_input_is_history_and_needs_the_user_turn_before_it(
        http_daemon: HttpDaemon, stub: StubOpenAI) -> None:
    async with sdk(http_daemon) as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.responses.create(model="openai/stub-model", input=[
                {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "12C"}])
    assert caught.value.code == ErrorCode.VALIDATION_ERROR
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "input.0.role"
    assert stored(http_daemon.daemon) == [] and stub.requests == []
