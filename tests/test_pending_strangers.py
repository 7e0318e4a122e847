"""A conversation waiting with pending input is continued by a request naming no conversation only
when that request runs under the conversation's system prompt, and only for a bounded time after
its input was added (`pending_match_window`): a stranger whose first turn happens to be the same
text starts a conversation of its own. On the socket, on both backends."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import openai
import pytest

from ksi_daemon.daemon import Daemon
from tests.conftest import complete, connected, running_daemon, running_http_daemon, stub_settings
from tests.stub_openai import StubOpenAI

pytestmark = pytest.mark.backends

PRIVATE = "You help Ada. Her account number is 12345."
HI = {"type": "message", "role": "user", "content": "Hi"}


async def waiting_conversation(client: Any, system: str | None, *pending: str) -> str:
    """A conversation with no exchanges holding `pending` under `system` (as the Conversations API
    creates one from a system item and a user item)."""
    document = {"format": "ksi.conversation", "v": 1, "conversation": {"system": system}, "exchanges": []}
    made = await client.request("conversation:import", {"data": document, "format": "json", "pending": list(pending)})
    return str(made["conversation_id"])


async def still_waiting(client: Any, conversation_id: str) -> bool:
    shown = await client.request("conversation:show", {"conversation_id": conversation_id})
    return not shown["exchanges"] and [p["content"] for p in shown["conversation"]["pending_input"]] == ["Hi"]


async def test_a_stranger_with_the_same_first_turn_does_not_join_a_conversation_with_a_system_prompt(
        stub_daemon: Daemon, stub: StubOpenAI) -> None:
    async with connected(stub_daemon) as client:
        waiting = await waiting_conversation(client, PRIVATE, "Hi")
        strangers = [{"instructions": "You are a pirate."}, {"system": "You are a pirate."}, {}]
        for stranger in strangers:
            result = await complete(client, input=[HI], **stranger)
            assert result["conversation_id"] != waiting, stranger
            assert await still_waiting(client, waiting), stranger
        assert all(PRIVATE not in str(message) for message in stub.messages())  # never sent to a stranger
        owner = await complete(client, input=[HI], instructions=PRIVATE)
        assert owner["conversation_id"] == waiting
        assert not await still_waiting(client, waiting)


async def test_a_conversation_without_a_system_prompt_is_joined_under_the_requests_instructions(
        stub_daemon: Daemon) -> None:
    """The Agents SDK's session: the conversation is made bare, its instructions come with each request."""
    async with connected(stub_daemon) as client:
        waiting = await waiting_conversation(client, None, "Hi")
        result = await complete(client, input=[HI], instructions="Reply very concisely.")
        assert result["conversation_id"] == waiting


async def test_pending_input_stops_being_matched_once_its_window_has_passed(
        short_tmp: Path, stub: StubOpenAI, backend: dict[str, Any]) -> None:
    async with running_daemon(short_tmp, **stub_settings(stub), **backend, pending_match_window=0) as daemon, \
            connected(daemon) as client:
        waiting = await waiting_conversation(client, None, "Hi")
        result = await complete(client, input=[HI])
        assert result["conversation_id"] != waiting  # 0: never matched without its id
        assert await still_waiting(client, waiting)
        named = await complete(client, input=[HI], conversation_id=waiting)  # by its id, always
        assert named["conversation_id"] == waiting
    async with running_daemon(short_tmp, **stub_settings(stub), **backend, pending_match_window=0.5) as daemon, \
            connected(daemon) as client:
        waiting = await waiting_conversation(client, None, "Hi")
        await asyncio.sleep(0.6)  # past the window whatever the machine's speed: no timing is asserted
        result = await complete(client, input=[HI])
        assert result["conversation_id"] != waiting
        assert await still_waiting(client, waiting)


async def test_the_conversations_api_scenario_keeps_a_stranger_out(
        short_tmp: Path, stub: StubOpenAI, backend: dict[str, Any]) -> None:
    """Program X makes its conversation from a developer item and "Hi"; program Y asks with "Hi"
    and instructions of its own, naming no conversation, as an SDK session does."""
    async with running_http_daemon(short_tmp, **stub_settings(stub), **backend) as http, \
            openai.AsyncOpenAI(base_url=f"{http.base_url}/v1", api_key=http.token, max_retries=0) as api:
        made = await api.conversations.create(items=[{"type": "message", "role": "developer", "content": PRIVATE},
                                                     {"type": "message", "role": "user", "content": "Hi"}])
        stranger = await api.responses.create(input=[HI], instructions="You are a pirate.")
        assert stranger.conversation is not None and stranger.conversation.id != made.id
        assert PRIVATE not in str(stub.messages())
        items = await api.conversations.items.list(made.id, order="asc")
        assert [item.content[0].text for item in items.data] == ["Hi"]  # type: ignore[union-attr]
