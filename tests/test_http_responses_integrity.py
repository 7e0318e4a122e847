"""Background responses and their conversation: a deleted conversation's answers are no longer
served by id (neither as an object nor as a stream), and a background response still running is
named as such when a client continues after it, never "not found". On both storage backends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest

from ksi_common.errors import ErrorCode
from ksi_daemon.context import EventContext
from tests.conftest import HttpDaemon, running_http_daemon, stub_settings
from tests.stub_openai import Reply, StubOpenAI
from tests.test_http_responses_background import fetched, until

pytestmark = pytest.mark.backends


@pytest.fixture
async def http(short_tmp: Path, stub: StubOpenAI, backend: dict[str, Any]) -> AsyncIterator[HttpDaemon]:
    async with running_http_daemon(short_tmp, **stub_settings(stub), **backend) as running:
        yield running


@pytest.fixture
async def client(http: HttpDaemon) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{http.base_url}/v1", api_key=http.token, max_retries=0) as api:
        yield api


async def test_a_deleted_conversations_background_answers_are_not_served(
        http: HttpDaemon, client: openai.AsyncOpenAI) -> None:
    created = await client.responses.create(model="openai/stub-model", input="secret", background=True)
    done = await until(lambda: fetched(client, created.id), lambda r: r["status"] == "completed")
    conversation_id = done["conversation"]["id"]
    deleted = await http.daemon.router.request("conversation:delete", {"conversation_id": conversation_id},
                                               EventContext.root())
    assert deleted["deleted"] is True
    with pytest.raises(openai.NotFoundError) as shown:
        await client.responses.retrieve(created.id)
    assert shown.value.code == ErrorCode.RESPONSE_NOT_FOUND
    with pytest.raises(openai.NotFoundError) as streamed:
        await client.responses.retrieve(created.id, stream=True)
    assert streamed.value.code == ErrorCode.RESPONSE_NOT_FOUND
    with pytest.raises(openai.NotFoundError) as cancelled:
        await client.responses.cancel(created.id)
    assert cancelled.value.code == ErrorCode.RESPONSE_NOT_FOUND


async def test_a_running_background_response_named_as_previous_is_said_to_be_running(
        http: HttpDaemon, client: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    gate = asyncio.Event()
    stub.enqueue(Reply(text="first answer", gate=gate))
    created = await client.responses.create(model="openai/stub-model", input="first", background=True)
    await until(lambda: fetched(client, created.id), lambda r: r["status"] == "in_progress")
    listed = await http.daemon.router.request("conversation:list", {}, EventContext.root())
    with pytest.raises(openai.ConflictError) as running:
        await client.responses.create(model="openai/stub-model", input="second", previous_response_id=created.id)
    assert running.value.code == ErrorCode.PREVIOUS_RESPONSE_IN_PROGRESS
    assert isinstance(running.value.body, dict) and running.value.body["param"] == "previous_response_id"
    # nothing was written for the refusal: no conversation of its own, nothing pended
    assert (await http.daemon.router.request("conversation:list", {}, EventContext.root())) == listed
    gate.set()
    done = await until(lambda: fetched(client, created.id), lambda r: r["status"] == "completed")
    second = await client.responses.create(model="openai/stub-model", input="second",
                                           previous_response_id=created.id)
    assert second.conversation is not None and second.conversation.id == done["conversation"]["id"]
    assert [m["content"] for m in stub.messages()] == ["first", "first answer", "second"]
