"""The OpenAI-compatible door with the official `openai` SDK (async and sync clients) against a
real in-process daemon, through real litellm to the local stub."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest

from ksi_common.jsonl import read_records
from ksi_daemon.context import EventContext
from tests.conftest import HttpDaemon, running_http_daemon, stub_settings
from tests.stub_openai import StubOpenAI


def sdk(http: HttpDaemon) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{http.base_url}/v1", api_key=http.token, max_retries=0)


def seen(stub: StubOpenAI, index: int = -1) -> list[tuple[str, str]]:
    """What the stub was sent: (role, content) pairs."""
    return [(m["role"], m["content"]) for m in stub.messages(index)]


def ksi_id(response_id: str) -> str:
    """The KSI response id of a Responses id (`resp_` and the KSI id)."""
    assert response_id.startswith("resp_")
    return response_id.removeprefix("resp_")


def index_of(http: HttpDaemon, conversation_id: str) -> list[dict[str, Any]]:
    return read_records(http.daemon.layout.index_file(conversation_id))


async def request(http: HttpDaemon, event: str, data: dict[str, Any]) -> dict[str, Any]:
    return await http.daemon.router.request(event, data, EventContext.root())


@pytest.fixture
async def client(http_daemon: HttpDaemon) -> AsyncIterator[openai.AsyncOpenAI]:
    async with sdk(http_daemon) as api:
        yield api


async def test_two_responses_chained_by_previous_response_id(
        http_daemon: HttpDaemon, client: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    first = await client.responses.create(model="openai/stub-model", input="My name is Ada")
    assert first.output_text == "stub answer to: My name is Ada"
    assert http_daemon.daemon.layout.response_file(ksi_id(first.id)).exists()  # resp_ and the KSI response_id
    second = await client.responses.create(input="What is my name?", previous_response_id=first.id)
    assert seen(stub) == [("user", "My name is Ada"), ("assistant", "stub answer to: My name is Ada"),
                          ("user", "What is my name?")]
    assert second.previous_response_id == first.id
    assert second.conversation is not None and first.conversation is not None
    assert second.conversation.id == first.conversation.id
    assert [line["response_id"] for line in index_of(http_daemon, first.conversation.id)] == [ksi_id(first.id), ksi_id(second.id)]
    assert second.usage is not None and second.usage.input_tokens > 0


async def test_conversations_made_through_http_say_so(http_daemon: HttpDaemon, client: openai.AsyncOpenAI) -> None:
    await client.responses.create(model="openai/stub-model", input="via responses")
    await client.chat.completions.create(model="openai/stub-model", messages=[{"role": "user", "content": "via chat"}])
    await client.chat.completions.create(model="openai/stub-model", messages=[
        {"role": "user", "content": "a history of its own"}, {"role": "assistant", "content": "kept"},
        {"role": "user", "content": "and a new turn"}])
    listing = await request(http_daemon, "conversation:list", {})
    assert sorted((c["origin"], c["preview"]) for c in listing["conversations"]) == [
        ("http", "a history of its own"), ("http", "via chat"), ("http", "via responses")]


async def test_sync_client_chains_too(http_daemon: HttpDaemon, stub: StubOpenAI) -> None:
    def chain() -> tuple[str, str]:
        with openai.OpenAI(base_url=f"{http_daemon.base_url}/v1", api_key=http_daemon.token, max_retries=0) as api:
            first = api.responses.create(input="one", instructions="Be brief.")
            second = api.responses.create(input="two", previous_response_id=first.id)
            return first.id, second.id

    # the server runs on this test's loop: a blocking client must run beside it
    first_id, second_id = await asyncio.to_thread(chain)
    assert seen(stub, 0) == [("system", "Be brief."), ("user", "one")]
    # instructions are not carried to the next response
    assert seen(stub) == [("user", "one"), ("assistant", "stub answer to: one"), ("user", "two")]
    shown = await request(http_daemon, "response:show", {"response_id": ksi_id(second_id)})
    assert shown["exchange"] == 2 and shown["newest"]


async def test_chain_continues_after_a_daemon_restart(short_tmp: Path, stub: StubOpenAI) -> None:
    async with running_http_daemon(short_tmp, **stub_settings(stub)) as http, sdk(http) as api:
        first = await api.responses.create(input="remember 42")
    async with running_http_daemon(short_tmp, **stub_settings(stub)) as http, sdk(http) as api:
        second = await api.responses.create(input="what number?", previous_response_id=first.id)
    assert seen(stub) == [("user", "remember 42"), ("assistant", "stub answer to: remember 42"),
                          ("user", "what number?")]
    assert second.conversation and first.conversation and second.conversation.id == first.conversation.id


async def test_previous_response_id_of_an_older_exchange_continues_a_fork(
        http_daemon: HttpDaemon, client: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    one = await client.responses.create(input="u1")
    two = await client.responses.create(input="u2", previous_response_id=one.id)
    three = await client.responses.create(input="u3", previous_response_id=two.id)
    assert one.conversation is not None
    original = one.conversation.id
    before = index_of(http_daemon, original)
    branch = await client.responses.create(input="u1b", previous_response_id=one.id)
    assert seen(stub) == [("user", "u1"), ("assistant", "stub answer to: u1"), ("user", "u1b")]
    assert branch.conversation is not None and branch.conversation.id != original
    assert index_of(http_daemon, original) == before  # the original is untouched
    assert (await client.responses.retrieve(branch.id)).previous_response_id == one.id  # across the fork
    assert (await client.responses.retrieve(three.id)).previous_response_id == two.id
    assert (await client.responses.retrieve(one.id)).previous_response_id is None
    fork = await request(http_daemon, "conversation:show", {"conversation_id": branch.conversation.id})
    assert fork["conversation"]["parent_id"] == original and fork["conversation"]["fork_at"] == 1
    assert [e["response_id"] for e in fork["exchanges"]] == [ksi_id(one.id), ksi_id(branch.id)]  # shared, not copied
    # the newest response still continues the original itself
    four = await client.responses.create(input="u4", previous_response_id=three.id)
    assert four.conversation is not None and four.conversation.id == original
    assert len(index_of(http_daemon, original)) == 4


async def test_conversation_objects_with_items(
        http_daemon: HttpDaemon, client: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    conversation = await client.conversations.create(
        items=[{"type": "message", "role": "system", "content": "You are terse."},
               {"type": "message", "role": "user", "content": "Hi, I am Bo"},
               {"type": "message", "role": "assistant", "content": "Hello Bo"}],
        metadata={"project": "alpha"})
    assert conversation.metadata == {"project": "alpha"}
    reply = await client.responses.create(input="Who am I?", conversation=conversation.id)
    assert seen(stub) == [("system", "You are terse."), ("user", "Hi, I am Bo"), ("assistant", "Hello Bo"),
                          ("user", "Who am I?")]
    assert reply.conversation is not None and reply.conversation.id == conversation.id
    items = await client.conversations.items.list(conversation.id, order="asc")
    texts = [(item.role, item.content[0].text) for item in items.data]  # type: ignore[union-attr]
    assert texts == [("user", "Hi, I am Bo"), ("assistant", "Hello Bo"), ("user", "Who am I?"),
                     ("assistant", "stub answer to: Who am I?")]
    added = await client.conversations.items.create(conversation.id, items=[
        {"type": "message", "role": "user", "content": "I moved to Oslo"},
        {"type": "message", "role": "assistant", "content": "Noted, Oslo"}])
    assert [(item.role, item.content[0].text) for item in added.data] == [  # type: ignore[union-attr]
        ("user", "I moved to Oslo"), ("assistant", "Noted, Oslo")]
    await client.responses.create(input="Where do I live?", conversation=conversation.id)
    assert seen(stub)[-3:] == [("user", "I moved to Oslo"), ("assistant", "Noted, Oslo"), ("user", "Where do I live?")]
    assert [line["n"] for line in index_of(http_daemon, conversation.id)] == [1, 2, 3, 4]
    with pytest.raises(openai.BadRequestError) as unpaired:
        await client.conversations.items.create(conversation.id, items=[
            {"type": "message", "role": "assistant", "content": "a reply to nothing"}])
    assert unpaired.value.code == "validation_error"
    assert len(index_of(http_daemon, conversation.id)) == 4
    updated = await client.conversations.update(conversation.id, metadata={"project": "beta"})
    assert updated.metadata == {"project": "beta"}
    assert (await client.conversations.retrieve(conversation.id)).metadata == {"project": "beta"}
    deleted = await client.conversations.delete(conversation.id)
    assert deleted.deleted
    with pytest.raises(openai.NotFoundError) as caught:
        await client.conversations.retrieve(conversation.id)
    assert caught.value.code == "conversation_not_found"


async def test_responses_stream_yields_deltas_and_a_final_response_that_continues(
        http_daemon: HttpDaemon, client: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    kinds: list[str] = []
    deltas: list[str] = []
    async with client.responses.stream(model="openai/stub-model", input="tell me a story") as stream:
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = await stream.get_final_response()
    assert "".join(deltas) == final.output_text == "stub answer to: tell me a story"
    assert len(deltas) > 1
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    nxt = await client.responses.create(input="and then?", previous_response_id=final.id)
    assert seen(stub)[:2] == [("user", "tell me a story"), ("assistant", "stub answer to: tell me a story")]
    assert nxt.conversation and final.conversation and nxt.conversation.id == final.conversation.id


async def test_retrieve_input_items_and_delete_a_response(
        http_daemon: HttpDaemon, client: openai.AsyncOpenAI) -> None:
    created = await client.responses.create(
        input=[{"role": "user", "content": "part one"}, {"role": "user", "content": "part two"}],
        metadata={"k": "v"})
    fetched = await client.responses.retrieve(created.id)
    assert fetched.id == created.id and fetched.output_text == created.output_text
    assert fetched.status == "completed" and fetched.metadata == {"k": "v"}
    items = await client.responses.input_items.list(created.id, order="asc")
    assert [item.content[0].text for item in items.data] == ["part one", "part two"]  # type: ignore[union-attr]
    with pytest.raises(openai.ConflictError) as caught:
        await client.responses.delete(created.id)
    assert caught.value.code == "response_not_deletable"
    assert http_daemon.daemon.layout.response_file(ksi_id(created.id)).exists()
    with pytest.raises(openai.NotFoundError) as missing:
        await client.responses.retrieve("openai-stub-model-000000000000")
    assert missing.value.code == "response_not_found"


async def test_chat_completions_continue_by_conversation_id(
        http_daemon: HttpDaemon, client: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    raw = await client.chat.completions.with_raw_response.create(
        model="openai/stub-model", messages=[{"role": "system", "content": "Short answers."},
                                             {"role": "user", "content": "I like tea"}])
    first = raw.parse()
    conversation_id = raw.headers["x-ksi-conversation-id"]
    assert (first.model_extra or {})["conversation_id"] == conversation_id
    second = await client.chat.completions.create(
        model="openai/stub-model", messages=[{"role": "user", "content": "What do I like?"}],
        extra_body={"conversation_id": conversation_id})
    assert seen(stub) == [("system", "Short answers."), ("user", "I like tea"),
                          ("assistant", "stub answer to: I like tea"), ("user", "What do I like?")]
    assert second.choices[0].message.content == "stub answer to: What do I like?"
    # the header works as well, and a stream continues the same conversation
    chunks = []
    stream = await client.chat.completions.create(
        model="openai/stub-model", messages=[{"role": "user", "content": "Again?"}], stream=True,
        extra_headers={"X-KSI-Conversation-Id": conversation_id})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            chunks.append(chunk.choices[0].delta.content)
    assert "".join(chunks) == "stub answer to: Again?"
    assert len(index_of(http_daemon, conversation_id)) == 3
    with pytest.raises(openai.NotFoundError) as caught:
        await client.chat.completions.create(model="openai/stub-model", messages=[{"role": "user", "content": "x"}],
                                             extra_body={"conversation_id": "conv-unknown"})
    assert caught.value.code == "conversation_not_found"
    created = await client.chat.completions.create(
        model="openai/stub-model", messages=[{"role": "user", "content": "x"}],
        extra_body={"conversation_id": "conv-made-here", "create": True})
    assert (created.model_extra or {})["conversation_id"] == "conv-made-here"


async def test_chat_completions_without_a_conversation_keep_the_clients_history(
        http_daemon: HttpDaemon, client: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    reply = await client.chat.completions.create(model="openai/stub-model", messages=[
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}])
    assert seen(stub) == [("user", "a"), ("assistant", "b"), ("user", "c")]
    conversation_id = (reply.model_extra or {})["conversation_id"]
    assert len(index_of(http_daemon, conversation_id)) == 2  # logged as a conversation: the import, then the call


def judge_or_member(messages: list[dict[str, Any]]) -> str:
    text = json.dumps(messages)
    if "confidence" in text:  # the arbiter is asked for a verdict
        return json.dumps({"synthesis": "together: yes", "confidence": 0.95, "dissent": "",
                           "refinement_areas": [], "needs_iteration": False, "ranking": [1]})
    return "member says yes"


async def test_consortium_and_agent_as_models(short_tmp: Path) -> None:
    async with StubOpenAI(answer=judge_or_member) as stub, \
            running_http_daemon(short_tmp, **stub_settings(stub)) as http, sdk(http) as api:
        await request(http, "consortium:save", {"name": "pair", "members": ["openai/stub-a", "openai/stub-b"],
                                                "arbiter": "openai/stub-judge"})
        answer = await api.responses.create(model="consortium/pair", input="should we?")
        assert answer.output_text == "together: yes"
        follow = await api.responses.create(model="consortium/pair", input="sure?", previous_response_id=answer.id)
        assert follow.conversation and answer.conversation and follow.conversation.id == answer.conversation.id

        spawned = await request(http, "agent:spawn", {"agent_id": "helper", "profile": "assistant"})
        models = [model.id async for model in api.models.list()]
        assert "consortium/pair" in models and "agent/helper" in models
        said = await api.responses.create(model="agent/helper", input="hello agent")
        assert said.conversation is not None and said.conversation.id == spawned["conversation_id"]
        assert said.output_text == "member says yes"
        with pytest.raises(openai.NotFoundError) as caught:
            await api.responses.create(model="agent/nobody", input="hi")
        assert caught.value.code == "agent_not_found"
