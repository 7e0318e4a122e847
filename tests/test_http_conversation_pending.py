"""The Conversations API as the SDKs use it: user items added before a response is asked for wait
as the conversation's pending input (in its metadata, on both backends) and the next response on
that conversation takes them as its first input, clearing them in the same commit."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import openai
import pytest

from ksi_common.errors import ErrorCode
from ksi_daemon.context import EventContext
from tests.conftest import HttpDaemon, running_http_daemon, stub_settings
from tests.responses_conformance import (
    conforming_conversation,
    conforming_conversation_items,
    conforming_input_items,
    conforming_response,
)
from tests.stub_openai import Reply, StubOpenAI

pytestmark = pytest.mark.backends
T = TypeVar("T")


def sdk(http: HttpDaemon) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{http.base_url}/v1", api_key=http.token, max_retries=0)


async def request(http: HttpDaemon, event: str, data: dict[str, Any]) -> dict[str, Any]:
    return await http.daemon.router.request(event, data, EventContext.root())


async def shown(http: HttpDaemon, conversation_id: str) -> dict[str, Any]:
    return await request(http, "conversation:show", {"conversation_id": conversation_id})


async def item_texts(api: openai.AsyncOpenAI, conversation_id: str) -> list[tuple[str, str]]:
    raw = await api.conversations.items.with_raw_response.list(conversation_id, order="asc")
    items = conforming_conversation_items(raw.http_response.json())
    return [(item.role, item.content[0].text) for item in items.data]  # type: ignore[union-attr]


async def until(probe: Callable[[], Awaitable[T]], done: Callable[[T], bool]) -> T:
    """Poll `probe` until `done` holds for its value (a safety net of a minute, not a timing check)."""
    async with asyncio.timeout(60):
        while True:
            value = await probe()
            if done(value):
                return value
            await asyncio.sleep(0.02)


async def test_items_given_at_creation_are_the_first_exchanges_input_after_a_restart(
        short_tmp: Path, stub: StubOpenAI, backend: dict[str, Any]) -> None:
    settings = {**stub_settings(stub), **backend}
    async with running_http_daemon(short_tmp, **settings) as http, sdk(http) as api:
        raw = await api.conversations.with_raw_response.create(
            items=[{"type": "message", "role": "user", "content": "My name is Ada"}], metadata={"app": "x"})
        conversation = conforming_conversation(raw.http_response.json())
        assert await item_texts(api, conversation.id) == [("user", "My name is Ada")]
        assert (await shown(http, conversation.id))["exchanges"] == []
    async with running_http_daemon(short_tmp, **settings) as http, sdk(http) as api:  # held in the metadata
        assert await item_texts(api, conversation.id) == [("user", "My name is Ada")]
        raw = await api.responses.with_raw_response.create(input="What is my name?", conversation=conversation.id)
        reply = conforming_response(raw.http_response.json())
        assert reply.conversation is not None and reply.conversation.id == conversation.id
        assert stub.messages() == [{"role": "user", "content": "My name is Ada"},
                                   {"role": "user", "content": "What is my name?"}]
        after = await shown(http, conversation.id)
        assert after["conversation"]["pending_input"] == []  # cleared with the exchange that took it
        assert [[line["content"] for line in e["inputs"]] for e in after["exchanges"]] == [
            ["My name is Ada", "What is my name?"]]
        listing = await request(http, "conversation:list", {})
        assert [c["conversation_id"] for c in listing["conversations"]] == [conversation.id]  # ONE conversation
        assert (await api.conversations.retrieve(conversation.id)).metadata == {"app": "x"}
        assert await item_texts(api, conversation.id) == [
            ("user", "My name is Ada"), ("user", "What is my name?"), ("assistant", "stub answer to: What is my name?")]
        inputs = await api.responses.input_items.with_raw_response.list(reply.id, order="asc")
        assert [item.content[0].text for item in conforming_input_items(inputs.http_response.json())] == [
            "My name is Ada", "What is my name?"]
    async with running_http_daemon(short_tmp, **settings) as http:  # the clearing was durable too
        assert (await shown(http, conversation.id))["conversation"]["pending_input"] == []


async def test_a_user_item_added_later_waits_and_a_failed_response_leaves_it_waiting(
        short_tmp: Path, stub: StubOpenAI, backend: dict[str, Any]) -> None:
    async with running_http_daemon(short_tmp, **stub_settings(stub), **backend) as http, sdk(http) as api:
        conversation = await api.conversations.create()
        first = await api.responses.create(input="one", conversation=conversation.id)
        raw = await api.conversations.items.with_raw_response.create(conversation.id, items=[
            {"type": "message", "role": "user", "content": "I moved to Oslo"}])
        added = conforming_conversation_items(raw.http_response.json())
        assert [(item.role, item.content[0].text) for item in added.data] == [  # type: ignore[union-attr]
            ("user", "I moved to Oslo")]
        with pytest.raises(openai.BadRequestError) as empty:
            await api.conversations.items.create(conversation.id, items=[
                {"type": "message", "role": "user", "content": "  "}])
        assert empty.value.code == ErrorCode.VALIDATION_ERROR
        stub.enqueue(Reply(status=400, body='{"error": {"message": "refused", "type": "invalid_request_error"}}'))
        with pytest.raises(openai.APIStatusError) as failed:
            await api.responses.create(input="where do I live?", conversation=conversation.id)
        assert failed.value.code == ErrorCode.PROVIDER_ERROR
        held = await shown(http, conversation.id)
        assert [item["content"] for item in held["conversation"]["pending_input"]] == ["I moved to Oslo"]
        assert len(held["exchanges"]) == 1  # the failure wrote no exchange and took nothing
        second = await api.responses.create(input="where do I live?", conversation=conversation.id)
        assert stub.messages() == [{"role": "user", "content": "one"},
                                   {"role": "assistant", "content": "stub answer to: one"},
                                   {"role": "user", "content": "I moved to Oslo"},
                                   {"role": "user", "content": "where do I live?"}]
        assert [e["response_id"] for e in (await shown(http, conversation.id))["exchanges"]] == [
            first.id.removeprefix("resp_"), second.id.removeprefix("resp_")]


async def test_an_item_added_while_a_response_runs_waits_for_the_next_one(
        short_tmp: Path, stub: StubOpenAI, backend: dict[str, Any]) -> None:
    gate = asyncio.Event()
    stub.enqueue(Reply(text="first answer", gate=gate))
    async with running_http_daemon(short_tmp, **stub_settings(stub), **backend) as http, sdk(http) as api:
        conversation = await api.conversations.create()
        running = await api.responses.create(input="one", conversation=conversation.id, background=True)
        await until(lambda: api.responses.retrieve(running.id), lambda r: r.output_text == "first ")
        await api.conversations.items.create(conversation.id, items=[
            {"type": "message", "role": "user", "content": "meanwhile"}])
        gate.set()
        await until(lambda: api.responses.retrieve(running.id), lambda r: r.status == "completed")
        after = await shown(http, conversation.id)
        assert [[line["content"] for line in e["inputs"]] for e in after["exchanges"]] == [["one"]]
        assert [item["content"] for item in after["conversation"]["pending_input"]] == ["meanwhile"]
        await api.responses.create(input="two", conversation=conversation.id)
        assert stub.messages()[-2:] == [{"role": "user", "content": "meanwhile"}, {"role": "user", "content": "two"}]
        assert (await shown(http, conversation.id))["conversation"]["pending_input"] == []


async def test_an_assistant_item_answers_the_waiting_user_items_as_one_exchange(
        short_tmp: Path, stub: StubOpenAI, backend: dict[str, Any]) -> None:
    async with running_http_daemon(short_tmp, **stub_settings(stub), **backend) as http, sdk(http) as api:
        conversation = await api.conversations.create()
        with pytest.raises(openai.BadRequestError) as nothing_waits:
            await api.conversations.items.create(conversation.id, items=[
                {"type": "message", "role": "assistant", "content": "a reply to nothing"}])
        assert nothing_waits.value.code == ErrorCode.VALIDATION_ERROR
        assert isinstance(nothing_waits.value.body, dict) and nothing_waits.value.body["param"] == "items.0"
        assert (await shown(http, conversation.id))["exchanges"] == []  # nothing written
        # a client keeping its own session adds the user's item, is answered elsewhere, adds the answer
        await api.conversations.items.create(conversation.id, items=[
            {"type": "message", "role": "user", "content": "My name is Ada"}])
        raw = await api.conversations.items.with_raw_response.create(conversation.id, items=[
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello Ada"}]}])
        added = conforming_conversation_items(raw.http_response.json())
        assert [(item.role, item.content[0].text) for item in added.data] == [  # type: ignore[union-attr]
            ("assistant", "Hello Ada")]
        after = await shown(http, conversation.id)
        assert after["conversation"]["pending_input"] == []
        assert [([line["content"] for line in e["inputs"]], e["reply"]["content"]) for e in after["exchanges"]] == [
            (["My name is Ada"], "Hello Ada")]
        # with nothing waiting, the newest exchange's reply added again is the one held: nothing written
        raw = await api.conversations.items.with_raw_response.create(conversation.id, items=[
            {"type": "message", "role": "assistant", "content": "Hello Ada"}])
        again = conforming_conversation_items(raw.http_response.json())
        assert [(item.id, item.role) for item in again.data] == [  # type: ignore[union-attr]
            (item.id, "assistant") for item in added.data]  # type: ignore[union-attr]
        assert await shown(http, conversation.id) == after
        with pytest.raises(openai.BadRequestError) as another:
            await api.conversations.items.create(conversation.id, items=[
                {"type": "message", "role": "assistant", "content": "Hello Bob"}])
        assert another.value.code == ErrorCode.VALIDATION_ERROR
        assert isinstance(another.value.body, dict) and another.value.body["param"] == "items.0"
        assert await shown(http, conversation.id) == after
        await api.responses.create(input="Who am I?", conversation=conversation.id)
        assert stub.messages() == [{"role": "user", "content": "My name is Ada"},
                                   {"role": "assistant", "content": "Hello Ada"},
                                   {"role": "user", "content": "Who am I?"}]
