"""The Anthropic Messages door with the official `anthropic` SDK, as its users call it: text turns
whose whole history is resent each time end as ONE KSI conversation, the conversation is named on
every answer and may be named to continue it, and the stub (through real litellm) receives the
history KSI rebuilt or the client's own."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from ksi_daemon.context import EventContext
from tests.conftest import HttpDaemon, running_http_daemon, stub_settings
from tests.stub_openai import StubOpenAI
from tests.test_conversation_sent import as_sent

MODEL = "openai/stub-model"


def sdk(http: HttpDaemon, key: str | None = None) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=http.base_url, api_key=key or http.token, max_retries=0)


async def conversations(http: HttpDaemon) -> dict[str, int]:
    """Every conversation and its number of exchanges."""
    listing = await http.daemon.router.request("conversation:list", {"limit": 1000}, EventContext.root())
    return {c["conversation_id"]: c["exchanges"] for c in listing["conversations"]}


@pytest.fixture
async def client(http_daemon: HttpDaemon) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with sdk(http_daemon) as api:
        yield api


async def test_a_resent_history_is_one_conversation(
        http_daemon: HttpDaemon, client: anthropic.AsyncAnthropic, stub: StubOpenAI) -> None:
    messages: list[dict[str, Any]] = []
    named = set()
    for turn in ("I like tea", "and cake", "what do I like?"):
        messages.append({"role": "user", "content": turn})
        raw = await client.messages.with_raw_response.create(
            model=MODEL, max_tokens=200, system="Short answers.", messages=messages)  # type: ignore[arg-type]
        reply = await raw.parse()
        named.add(raw.headers["x-ksi-conversation-id"])
        assert reply.type == "message" and reply.role == "assistant" and reply.model == MODEL
        assert reply.stop_reason == "end_turn" and reply.usage.input_tokens > 0
        [block] = reply.content
        assert block.type == "text" and block.text == f"stub answer to: {turn}"
        messages.append({"role": "assistant", "content": [{"type": "text", "text": block.text}]})
    assert list((await conversations(http_daemon)).values()) == [3]
    assert named == set(await conversations(http_daemon))
    assert [(m["role"], m["content"]) for m in stub.messages()] == [
        ("system", "Short answers."), ("user", "I like tea"), ("assistant", "stub answer to: I like tea"),
        ("user", "and cake"), ("assistant", "stub answer to: and cake"), ("user", "what do I like?")]
    assert stub.requests[-1]["max_tokens"] == 200


async def test_the_conversation_header_continues_a_conversation(
        http_daemon: HttpDaemon, client: anthropic.AsyncAnthropic, stub: StubOpenAI) -> None:
    first = await client.messages.with_raw_response.create(
        model=MODEL, max_tokens=50, messages=[{"role": "user", "content": "remember 7"}])
    conversation_id = first.headers["x-ksi-conversation-id"]
    second = await client.messages.with_raw_response.create(
        model=MODEL, max_tokens=50, messages=[{"role": "user", "content": "which number?"}],
        extra_headers={"x-ksi-conversation-id": conversation_id})
    assert second.headers["x-ksi-conversation-id"] == conversation_id
    assert [m["content"] for m in stub.messages()] == ["remember 7", "stub answer to: remember 7", "which number?"]
    assert await conversations(http_daemon) == {conversation_id: 2}


async def test_a_history_that_differs_forks_where_it_differs(
        http_daemon: HttpDaemon, client: anthropic.AsyncAnthropic, stub: StubOpenAI) -> None:
    first = await client.messages.create(model=MODEL, max_tokens=50, messages=[{"role": "user", "content": "a"}])
    said = first.content[0].text  # type: ignore[union-attr]
    await client.messages.create(model=MODEL, max_tokens=50, messages=[
        {"role": "user", "content": "a"}, {"role": "assistant", "content": said}, {"role": "user", "content": "b"}])
    forked = await client.messages.with_raw_response.create(model=MODEL, max_tokens=50, messages=[
        {"role": "user", "content": "a"}, {"role": "assistant", "content": said}, {"role": "user", "content": "c"}])
    assert [m["content"] for m in stub.messages()] == ["a", said, "c"]
    counts = await conversations(http_daemon)
    assert len(counts) == 2 and counts[forked.headers["x-ksi-conversation-id"]] == 1  # its own: exchange 1 is shared
    assert sorted(counts.values()) == [1, 2]


async def test_metadata_user_id_scopes_the_matching(
        http_daemon: HttpDaemon, client: anthropic.AsyncAnthropic, stub: StubOpenAI) -> None:
    """Two users sending the same opening do not continue each other's conversation."""
    history: list[Any] = [{"role": "user", "content": "hello"}]
    for user in ("alice", "bob"):
        first = await client.messages.create(model=MODEL, max_tokens=50, messages=history,
                                             metadata={"user_id": user})
        resent: Any = [*history, {"role": "assistant", "content": first.content[0].text},  # type: ignore[union-attr]
                       {"role": "user", "content": "again"}]
        await client.messages.create(model=MODEL, max_tokens=50, metadata={"user_id": user}, messages=resent)
    assert sorted((await conversations(http_daemon)).values()) == [2, 2]
    assert stub.requests[-1]["user"] == "bob"


async def test_model_list_in_anthropic_shape(client: anthropic.AsyncAnthropic) -> None:
    page = await client.models.list()
    assert MODEL in [model.id for model in page.data]
    assert all(model.type == "model" for model in page.data)
    assert (await client.models.retrieve(MODEL)).id == MODEL


async def test_an_unknown_conversation_header_is_404(
        http_daemon: HttpDaemon, client: anthropic.AsyncAnthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as refused:
        await client.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "hi"}],
                                     extra_headers={"x-ksi-conversation-id": "no-such-conversation"})
    assert refused.value.body["error"]["code"] == "conversation_not_found"  # type: ignore[index]
    assert await conversations(http_daemon) == {}


async def test_a_session_resent_after_another_door_added_a_turn_forks_before_it(
        http_daemon: HttpDaemon, client: anthropic.AsyncAnthropic, stub: StubOpenAI) -> None:
    history: list[Any] = [{"role": "user", "content": "first"}]
    raw = await client.messages.with_raw_response.create(model=MODEL, max_tokens=10, messages=history)
    conversation_id = raw.headers["x-ksi-conversation-id"]
    history.append({"role": "assistant", "content": (await raw.parse()).content[0].text})  # type: ignore[union-attr]
    async with openai.AsyncOpenAI(base_url=f"{http_daemon.base_url}/v1", api_key=http_daemon.token,
                                  max_retries=0) as api:
        await api.responses.create(model=MODEL, input="from elsewhere", conversation=conversation_id)
    # the session's own history ends before that turn: a fork there, the other turn left in place
    forked = await client.messages.with_raw_response.create(
        model=MODEL, max_tokens=10, messages=[*history, {"role": "user", "content": "second"}])
    assert forked.headers["x-ksi-conversation-id"] != conversation_id
    assert [m["content"] for m in stub.messages()] == ["first", "stub answer to: first", "second"]
    # named, the conversation itself continues with only the new turn
    await client.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "third"}],
                                 extra_headers={"x-ksi-conversation-id": conversation_id})
    assert [m["content"] for m in stub.messages()][-3:] == ["from elsewhere", "stub answer to: from elsewhere",
                                                            "third"]
    assert (await conversations(http_daemon))[conversation_id] == 3


async def test_what_was_sent_for_a_messages_turn_is_shown_like_any_other(
        http_daemon: HttpDaemon, client: anthropic.AsyncAnthropic, stub: StubOpenAI) -> None:
    history: list[Any] = [{"role": "user", "content": "first"}]
    first = await client.messages.create(model=MODEL, max_tokens=10, system="Be brief.", messages=history)
    history += [{"role": "assistant", "content": first.content[0].text},  # type: ignore[union-attr]
                {"role": "user", "content": "second"}]
    raw = await client.messages.with_raw_response.create(model=MODEL, max_tokens=10, system="Be brief.",
                                                         messages=history)
    shown = await http_daemon.daemon.router.request(
        "conversation:sent", {"conversation_id": raw.headers["x-ksi-conversation-id"], "n": 2}, EventContext.root())
    assert as_sent(shown) == stub.messages(-1)
    assert [m["part"] for m in shown["messages"]] == ["system", "history", "history", "input"]


async def test_a_session_that_outgrows_the_window_gets_the_budgeted_rebuild(short_tmp: Path, stub: StubOpenAI) -> None:
    small = {"openai/stub-small": {"api_base": stub.api_base, "context_window": 400}}
    async with running_http_daemon(short_tmp, **stub_settings(stub, models=small)) as http, sdk(http) as api:
        history: list[Any] = []
        for turn in range(8):
            history.append({"role": "user", "content": f"turn {turn} " + "words " * 30})
            raw = await api.messages.with_raw_response.create(model="openai/stub-small", max_tokens=50,
                                                              messages=history)
            history.append({"role": "assistant", "content": (await raw.parse()).content[0].text})  # type: ignore[union-attr]
        assert raw.headers["x-ksi-history"] == "stored"  # the client's own no longer fits: KSI's rebuild
        # the turn's own request (a background summary request may come after it)
        sent = next(r["messages"] for r in reversed(stub.requests) if r["messages"][-1]["content"] == history[-2]["content"])
        assert len(sent) < len(history) - 1
        assert list((await conversations(http)).values()) == [8]


async def test_a_session_survives_a_daemon_restart(short_tmp: Path, stub: StubOpenAI) -> None:
    history: list[Any] = [{"role": "user", "content": "before the restart"}]
    async with running_http_daemon(short_tmp, **stub_settings(stub)) as http, sdk(http) as api:
        raw = await api.messages.with_raw_response.create(model=MODEL, max_tokens=10, messages=history)
        history.append({"role": "assistant", "content": (await raw.parse()).content[0].text})  # type: ignore[union-attr]
    history.append({"role": "user", "content": "after it"})
    async with running_http_daemon(short_tmp, **stub_settings(stub)) as http, sdk(http) as api:
        again = await api.messages.with_raw_response.create(model=MODEL, max_tokens=10, messages=history)
        assert again.headers["x-ksi-conversation-id"] == raw.headers["x-ksi-conversation-id"]
        assert again.headers["x-ksi-history"] == "client"
        assert list((await conversations(http)).values()) == [2]
