"""A client-held Responses history whose last output item carries the id this door gave it (an SDK
that keeps the items it was sent, ids and all) continues after the response that id names, as an
item id stands for the stored item on OpenAI: the stored conversation is the history, even when
the client's instructions changed since (an agents SDK handoff). An id of that form naming no
stored response, or an id of another server, leaves the history to be matched by content."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from ksi_daemon.context import EventContext
from tests.conftest import HttpDaemon
from tests.stub_openai import StubOpenAI
from tests.test_http_openai import ksi_id, sdk


@pytest.fixture
async def client(http_daemon: HttpDaemon) -> AsyncIterator[openai.AsyncOpenAI]:
    async with sdk(http_daemon) as api:
        yield api


async def conversations(http: HttpDaemon) -> list[dict[str, Any]]:
    listed = await http.daemon.router.request("conversation:list", {}, EventContext.root())
    return list(listed["conversations"])


async def test_an_output_item_with_the_doors_id_continues_after_its_response(
        http_daemon: HttpDaemon, client: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    stub.enqueue("Hello Alice.", "You are Alice.")
    first = await client.responses.create(model="openai/stub-model", instructions="Greet people.",
                                          input="My name is Alice")
    reply = first.output[0].model_dump(exclude_none=True)
    assert reply["id"] == f"msg_{ksi_id(first.id)}"
    # the instructions changed (another agent answers): content matching would not find the history
    second = await client.responses.create(model="openai/stub-model", instructions="Answer questions.", input=[
        {"role": "user", "content": "My name is Alice"}, reply, {"role": "user", "content": "Who am I?"}])
    assert second.output_text == "You are Alice."
    assert [(m["role"], m["content"]) for m in stub.messages()] == [
        ("system", "Answer questions."), ("user", "My name is Alice"), ("assistant", "Hello Alice."),
        ("user", "Who am I?")]
    [conversation] = await conversations(http_daemon)
    assert conversation["exchanges"] == 2
    shown = await http_daemon.daemon.router.request("response:show", {"response_id": ksi_id(second.id)},
                                                    EventContext.root())
    assert shown["previous_response_id"] == ksi_id(first.id)


@pytest.mark.parametrize("item_id", ["msg_openai-stub-model-0123456789ab", "msg_67ccd3acc8d48190a77525dc6de64b41"])
async def test_an_id_naming_no_stored_response_leaves_the_history_to_be_matched(
        http_daemon: HttpDaemon, client: openai.AsyncOpenAI, stub: StubOpenAI, item_id: str) -> None:
    stub.enqueue("You are Bob.")
    response = await client.responses.create(model="openai/stub-model", input=[
        {"role": "user", "content": "My name is Bob"},
        {"type": "message", "role": "assistant", "id": item_id, "status": "completed",
         "content": [{"type": "output_text", "text": "Hello Bob.", "annotations": []}]},
        {"role": "user", "content": "Who am I?"}])
    assert response.output_text == "You are Bob."
    [conversation] = await conversations(http_daemon)
    assert conversation["exchanges"] == 2  # the history imported, the new turn answered after it
    assert [(m["role"], m["content"]) for m in stub.messages()] == [
        ("user", "My name is Bob"), ("assistant", "Hello Bob."), ("user", "Who am I?")]
