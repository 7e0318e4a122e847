"""A session's conversation takes over its run's own conversation, through the official `openai`
SDK as a session uses it: the session's conversation is made empty, the run's responses name no
conversation (so KSI stores them in a new one), and the run's items are added to the session's
conversation after the run. When the run's conversation holds exactly the session's items (none,
or a copy the run began with) then those, made moments before for the same scope and continued by
nothing since, the session's conversation takes those exchanges: one conversation, the run's
response ids continuing it. In every other case (the session's
conversation not empty, other items, the run's conversation continued since, another scope) the
items are added as any others and the run's conversation is left as it was."""

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
QUESTION: Any = {"type": "message", "role": "user", "content": "Weather in Oslo?"}
CALL: Any = {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": json.dumps({"city": "Oslo"})}
OUTPUT: Any = {"type": "function_call_output", "call_id": "call_1", "output": "12C"}
ANSWER: Any = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "It is 12C."}]}


async def listed(http: HttpDaemon) -> dict[str, int]:
    found = await http.daemon.router.request("conversation:list", {}, EventContext.root())
    return {c["conversation_id"]: c["exchanges"] for c in found["conversations"]}


async def run_alone(api: openai.AsyncOpenAI, stub: StubOpenAI, **options: Any) -> tuple[str, str]:
    """A tool run whose responses name no conversation, as a session asks them: the run's
    conversation and its last response's id."""
    stub.enqueue(Reply(calls=[{"id": "call_1", "name": "weather", "arguments": {"city": "Oslo"}}]), "It is 12C.")
    first = await api.responses.create(model="openai/stub-model", input=[QUESTION], tools=[WEATHER], **options)
    assert first.conversation is not None
    second = await api.responses.create(model="openai/stub-model", input=[QUESTION, CALL, OUTPUT],
                                        tools=[WEATHER], **options)
    assert second.output_text == "It is 12C."
    assert second.conversation is not None and second.conversation.id == first.conversation.id  # one run
    return first.conversation.id, second.id


async def test_the_run_s_items_added_to_an_empty_session_conversation_make_one_conversation(
        http: HttpDaemon, api: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    session = await api.conversations.create()
    run_conversation, last = await run_alone(api, stub)
    added = await api.conversations.items.create(session.id, items=[QUESTION, CALL, OUTPUT, ANSWER])
    assert [item.type for item in added.data] == ["message", "function_call", "function_call_output", "message"]
    assert await listed(http) == {session.id: 2}  # the run's conversation is gone, its exchanges the session's
    # the run's response ids continue the session's conversation
    stub.enqueue("Still 12C.")
    more = await api.responses.create(model="openai/stub-model", previous_response_id=last, input="And now?")
    assert more.conversation is not None and more.conversation.id == session.id
    stub.enqueue("Yes.")
    reply = await api.responses.create(model="openai/stub-model", conversation=session.id, input="Sure?")
    assert reply.output_text == "Yes."
    assert [m["role"] for m in stub.messages()] == ["user", "assistant", "tool", "assistant", "user", "assistant",
                                                    "user"]
    assert await listed(http) == {session.id: 4}
    assert run_conversation != session.id


async def test_a_session_conversation_whose_items_the_run_began_with_takes_the_run(
        http: HttpDaemon, api: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    opening: list[Any] = [{"type": "message", "role": "user", "content": "Hello"},
                          {"type": "message", "role": "assistant", "content": "Hi."}]
    session = await api.conversations.create(items=opening)
    # the session's items sent as history under instructions the session's conversation lacks:
    # no stored history matches, so the run's conversation begins with a copy of them
    stub.enqueue(Reply(calls=[{"id": "call_1", "name": "weather", "arguments": {"city": "Oslo"}}]), "It is 12C.")
    first = await api.responses.create(model="openai/stub-model", instructions="Answer briefly.",
                                       input=[*opening, QUESTION], tools=[WEATHER])
    assert first.conversation is not None and first.conversation.id != session.id
    last = await api.responses.create(model="openai/stub-model", instructions="Answer briefly.",
                                      input=[*opening, QUESTION, CALL, OUTPUT], tools=[WEATHER])
    assert await listed(http) == {session.id: 1, first.conversation.id: 3}
    added = await api.conversations.items.create(session.id, items=[QUESTION, CALL, OUTPUT, ANSWER])
    assert [item.type for item in added.data] == ["message", "function_call", "function_call_output", "message"]
    assert await listed(http) == {session.id: 3}
    stub.enqueue("Still 12C.")
    more = await api.responses.create(model="openai/stub-model", previous_response_id=last.id, input="And now?")
    assert more.conversation is not None and more.conversation.id == session.id
    assert [m["role"] for m in stub.messages()] == ["system", "user", "assistant", "user", "assistant", "tool",
                                                    "assistant", "user"]


async def test_a_session_conversation_holding_other_exchanges_takes_nothing(
        http: HttpDaemon, api: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    session = await api.conversations.create(items=[{"type": "message", "role": "user", "content": "Hello"},
                                                    {"type": "message", "role": "assistant", "content": "Hi."}])
    run_conversation, _last = await run_alone(api, stub)
    await api.conversations.items.create(session.id, items=[QUESTION, CALL, OUTPUT, ANSWER])
    assert await listed(http) == {session.id: 3, run_conversation: 2}


async def test_items_other_than_the_run_s_take_nothing(
        http: HttpDaemon, api: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    session = await api.conversations.create()
    run_conversation, _last = await run_alone(api, stub)
    other = {**ANSWER, "content": [{"type": "output_text", "text": "It is 13C."}]}
    await api.conversations.items.create(session.id, items=[QUESTION, CALL, OUTPUT, other])
    assert await listed(http) == {session.id: 2, run_conversation: 2}


async def test_a_run_conversation_continued_since_is_not_taken(
        http: HttpDaemon, api: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    session = await api.conversations.create()
    run_conversation, last = await run_alone(api, stub)
    stub.enqueue("Still 12C.")
    await api.responses.create(model="openai/stub-model", previous_response_id=last, input="And now?")
    await api.conversations.items.create(session.id, items=[QUESTION, CALL, OUTPUT, ANSWER])
    assert await listed(http) == {session.id: 2, run_conversation: 3}


async def test_a_run_of_another_scope_is_not_taken(
        http: HttpDaemon, api: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    session = await api.conversations.create()
    run_conversation, _last = await run_alone(api, stub, safety_identifier="someone-else")
    await api.conversations.items.create(session.id, items=[QUESTION, CALL, OUTPUT, ANSWER])
    assert await listed(http) == {session.id: 2, run_conversation: 2}
