"""`item_reference` input items through the Responses door with the official `openai` SDK: a
reference stands for the stored item it names (as the Vercel AI SDK sends, with `store` on, for
the assistant items KSI returned), in a history sent whole or after `previous_response_id`. An id
KSI never gave, an item of no stored response, or one of a conversation stored for someone else
is refused with `item_not_found` naming it, and nothing is written."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from ksi_daemon.context import EventContext
from tests.conftest import HttpDaemon
from tests.stub_openai import Reply, StubOpenAI

pytestmark = pytest.mark.backends

WEATHER: Any = {"type": "function", "name": "weather", "description": "the weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


async def exchanges(http: HttpDaemon) -> list[int]:
    listed = await http.daemon.router.request("conversation:list", {}, EventContext.root())
    return sorted(c["exchanges"] for c in listed["conversations"])


def roles_and_texts(stub: StubOpenAI) -> list[tuple[str, Any]]:
    return [(m["role"], m.get("content")) for m in stub.messages()]


def ref(item_id: str) -> dict[str, Any]:
    return {"type": "item_reference", "id": item_id}


async def test_a_reference_to_a_returned_message_continues_its_conversation(
        http: HttpDaemon, api: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    stub.enqueue("Hello Ada.", "You are Ada.")
    first = await api.responses.create(model="openai/stub-model", input="My name is Ada")
    second = await api.responses.create(model="openai/stub-model", input=[
        {"role": "user", "content": "My name is Ada"}, ref(first.output[0].id),  # type: ignore[union-attr]
        {"role": "user", "content": "Who am I?"}])
    assert second.output_text == "You are Ada."
    assert roles_and_texts(stub) == [("user", "My name is Ada"), ("assistant", "Hello Ada."), ("user", "Who am I?")]
    assert await exchanges(http) == [2]


async def test_references_within_a_history_stand_for_the_stored_items(
        http: HttpDaemon, api: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    stub.enqueue(Reply(calls=[{"id": "call_1", "name": "weather", "arguments": {"city": "Oslo"}}]), "It is 12C.",
                 "Bergen is wet.")
    step = await api.responses.create(model="openai/stub-model", input="Weather in Oslo?", tools=[WEATHER])
    done = await api.responses.create(model="openai/stub-model", previous_response_id=step.id, tools=[WEATHER],
                                      input=[{"type": "function_call_output", "call_id": "call_1", "output": "12C"}])
    assert done.output_text == "It is 12C."
    # the whole history resent, the call by reference (the answer as text: the history is matched
    # by content, not continued after the response a last item's id names), then a new turn
    await api.responses.create(model="openai/stub-model", tools=[WEATHER], input=[
        {"role": "user", "content": "Weather in Oslo?"}, ref(step.output[0].id),  # type: ignore[union-attr]
        {"type": "function_call_output", "call_id": "call_1", "output": "12C"},
        {"role": "assistant", "content": "It is 12C."}, {"role": "user", "content": "And Bergen?"}])
    sent = stub.messages()
    assert [m["role"] for m in sent] == ["user", "assistant", "tool", "assistant", "user"]
    assert sent[1]["tool_calls"][0]["id"] == "call_1" and sent[3]["content"] == "It is 12C."
    assert await exchanges(http) == [3]  # the history was the conversation's: continued in place


async def test_a_reference_after_previous_response_id_to_its_own_answer_is_that_answer(
        http: HttpDaemon, api: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    stub.enqueue("Hello.", "Again.")
    first = await api.responses.create(model="openai/stub-model", input="Hi")
    await api.responses.create(model="openai/stub-model", previous_response_id=first.id, input=[
        ref(first.output[0].id), {"role": "user", "content": "Once more"}])  # type: ignore[union-attr]
    assert roles_and_texts(stub) == [("user", "Hi"), ("assistant", "Hello."), ("user", "Once more")]
    assert await exchanges(http) == [2]


@pytest.mark.parametrize("item_id", ["msg_67ccd3acc8d48190a77525dc6de64b41", "msg_openai-stub-model-0123456789ab",
                                     "fc_openai-stub-model-0123456789ab_0"])
async def test_a_reference_naming_no_stored_item_is_item_not_found(
        http: HttpDaemon, api: openai.AsyncOpenAI, stub: StubOpenAI, item_id: str) -> None:
    with pytest.raises(openai.NotFoundError) as refused:
        await api.responses.create(model="openai/stub-model", input=[
            {"role": "user", "content": "Hi"}, ref(item_id), {"role": "user", "content": "and?"}])
    body = refused.value.body
    assert isinstance(body, dict) and body["code"] == "item_not_found" and item_id in body["message"]
    assert body["param"] == "input.1.id" or body["param"] == "input.1"
    assert await exchanges(http) == [] and stub.requests == []


async def test_a_reference_to_an_item_stored_for_someone_else_is_item_not_found(
        http: HttpDaemon, api: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    stub.enqueue("Hello Alice.")
    alices = await api.responses.create(model="openai/stub-model", input="My name is Alice", user="alice")
    with pytest.raises(openai.NotFoundError) as refused:
        await api.responses.create(model="openai/stub-model", user="bob", input=[
            {"role": "user", "content": "My name is Alice"}, ref(alices.output[0].id),  # type: ignore[union-attr]
            {"role": "user", "content": "What did you say?"}, {"role": "assistant", "content": "Nothing."},
            {"role": "user", "content": "Who am I?"}])
    body = refused.value.body
    assert isinstance(body, dict) and body["code"] == "item_not_found"
    assert "Hello Alice" not in body["message"]
    assert await exchanges(http) == [1] and len(stub.requests) == 1
