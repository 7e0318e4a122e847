"""Conversation items of every type through the Conversations API with the official `openai` SDK:
messages, function calls, their outputs and reasoning, given at creation or added later. They
become the conversation's exchanges (the inputs before each run of output items), replayed to the
provider on the next response; items the conversation already holds at its end are not added
again; user messages and call outputs after the last output item wait for the next response.
Bad items are refused with their code and leave the conversation as it was."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from ksi_daemon.context import EventContext
from tests.conftest import HttpDaemon
from tests.stub_openai import Reply, StubOpenAI

pytestmark = pytest.mark.backends

WEATHER: Any = {"type": "function", "name": "weather", "description": "the weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TOOL_TURN: list[Any] = [
    {"type": "message", "role": "user", "content": "Weather in Oslo?"},
    {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "use the tool"}]},
    {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": json.dumps({"city": "Oslo"})},
    {"type": "function_call_output", "call_id": "call_1", "output": "12C"},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "It is 12C."}]},
]


async def shown(http: HttpDaemon, conversation_id: str) -> dict[str, Any]:
    return await http.daemon.router.request("conversation:show", {"conversation_id": conversation_id},
                                            EventContext.root())


def sent(stub: StubOpenAI) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for message in stub.messages():
        if message.get("tool_calls"):
            out.append(("call", message["tool_calls"][0]["id"]))
        elif message["role"] == "tool":
            out.append(("output", message["tool_call_id"], message["content"]))
        else:
            out.append((message["role"], message["content"]))
    return out


async def test_tool_items_given_at_creation_are_exchanges_replayed_to_the_provider(
        http: HttpDaemon, api: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    conversation = await api.conversations.create(items=TOOL_TURN)
    listed = await api.conversations.items.list(conversation.id, order="asc")
    assert [item.type for item in listed.data] == ["message", "reasoning", "function_call", "function_call_output",
                                                   "message"]
    held = await shown(http, conversation.id)
    assert [[i["type"] for i in (*e["input"], *e["output"])] for e in held["exchanges"]] == [
        ["message", "reasoning", "function_call"], ["function_call_output", "message"]]
    stub.enqueue("Still 12C.")
    reply = await api.responses.create(model="openai/stub-model", conversation=conversation.id, input="And now?")
    assert reply.output_text == "Still 12C."
    assert sent(stub) == [("user", "Weather in Oslo?"), ("call", "call_1"), ("output", "call_1", "12C"),
                          ("assistant", "It is 12C."), ("user", "And now?")]


async def test_items_held_already_are_not_added_again_and_a_call_output_waits(
        http: HttpDaemon, api: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    stub.enqueue(Reply(calls=[{"id": "call_1", "name": "weather", "arguments": {"city": "Oslo"}}]), "It is 12C.")
    conversation = await api.conversations.create()
    await api.responses.create(model="openai/stub-model", conversation=conversation.id, input="Weather in Oslo?",
                               tools=[WEATHER])
    # the client adds the call it got (held already) and its output (waiting for the next response)
    added = await api.conversations.items.create(conversation.id, items=[TOOL_TURN[2], TOOL_TURN[3]])
    assert [item.type for item in added.data] == ["function_call_output"]
    assert len((await shown(http, conversation.id))["exchanges"]) == 1
    await api.responses.create(model="openai/stub-model", conversation=conversation.id, tools=[WEATHER],
                               input=[TOOL_TURN[3]])
    assert sent(stub)[-1] == ("output", "call_1", "12C")  # once: the waiting output is this input
    after = await shown(http, conversation.id)
    assert len(after["exchanges"]) == 2 and after["conversation"]["pending_input"] == []
    # the answer added after it is the one stored: listed as it is, nothing is added
    held = await api.conversations.items.create(conversation.id, items=[TOOL_TURN[4]])
    assert [item.type for item in held.data] == ["message"]
    assert len((await shown(http, conversation.id))["exchanges"]) == 2
    # a run's items added whole after its responses stored them: nothing is added either
    nothing = await api.conversations.items.create(conversation.id, items=TOOL_TURN[2:])
    assert nothing.data == [] and len((await shown(http, conversation.id))["exchanges"]) == 2


@pytest.mark.parametrize("items, param", [
    ([TOOL_TURN[3]], "items.0.call_id"),  # an output for no open call
    ([TOOL_TURN[2], TOOL_TURN[3]], "items.0"),  # a call with no input before it
    ([{"type": "message", "role": "assistant", "content": "out of nowhere"}], "items.0"),
    ([TOOL_TURN[0], {"type": "function_call", "call_id": "c", "arguments": "{}"}], "items.1.name"),
    ([{"type": "message", "role": "system", "content": "late"}, TOOL_TURN[0]], "items.0.role"),
])
async def test_bad_tool_items_are_refused_and_the_conversation_is_unchanged(
        http: HttpDaemon, api: openai.AsyncOpenAI, stub: StubOpenAI, items: list[Any], param: str) -> None:
    stub.enqueue("Hello.")
    conversation = await api.conversations.create()
    await api.responses.create(model="openai/stub-model", conversation=conversation.id, input="Hi")
    before = await shown(http, conversation.id)
    with pytest.raises(openai.BadRequestError) as refused:
        await api.conversations.items.create(conversation.id, items=items)
    body = refused.value.body
    assert isinstance(body, dict) and body["code"] == "validation_error" and body["param"] == param
    after = await shown(http, conversation.id)
    assert len(after["exchanges"]) == len(before["exchanges"]) == 1 and after["conversation"]["pending_input"] == []


async def test_a_conversation_created_with_bad_tool_items_is_not_made(
        http: HttpDaemon, api: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        await api.conversations.create(items=[TOOL_TURN[2], TOOL_TURN[3]])
    assert isinstance(refused.value.body, dict) and refused.value.body["code"] == "validation_error"
    listed = await http.daemon.router.request("conversation:list", {}, EventContext.root())
    assert listed["conversations"] == []
