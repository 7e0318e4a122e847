"""A client's own OpenAI `prompt_cache_breakpoint` on a content part, sent with the official openai
SDK through /v1/responses and Chat Completions: a model that takes explicit breakpoints receives it
on its message's block (and KSI places none of its own); the stored turn keeps it, so the next turn
replays it on the same message, as does a client resending its history with it; a model that does
not take them is sent none. `conversation:sent`
says the client placed it. A value that is not an object is refused naming its field, nothing
written. The stub server plays the provider, on both storage backends."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest

from ksi_common.errors import ErrorCode, KsiError
from tests.conftest import HttpDaemon, connected, running_http_daemon, stub_settings
from tests.stored import stored_response, stored_snapshot
from tests.stub_openai import StubOpenAI
from tests.test_http_openai import ksi_id

pytestmark = pytest.mark.backends

TAKES = "openai/gpt-5.6-stub"  # litellm: explicit breakpoints from gpt-5.6 on
PLAIN = "openai/stub-model"  # takes none
MARK = {"mode": "explicit"}


@pytest.fixture
async def http(short_tmp: Path, stub: StubOpenAI, backend: dict[str, Any]) -> AsyncIterator[HttpDaemon]:
    settings = stub_settings(stub, models={TAKES: {"api_base": stub.api_base}}, summariser="off")
    async with running_http_daemon(short_tmp, **settings, **backend) as running:
        yield running


def marked(body: dict[str, Any]) -> list[tuple[str, str]]:
    """Each block the provider received with a breakpoint: its message's role and its text."""
    return [(m["role"], block.get("text", "")) for m in body["messages"] if isinstance(m["content"], list)
            for block in m["content"] if "prompt_cache_breakpoint" in block]


async def sent(http: HttpDaemon, conversation_id: str, n: int) -> dict[str, Any]:
    async with connected(http.daemon) as client:
        return dict(await client.request("conversation:sent", {"conversation_id": conversation_id, "n": n}))


async def test_a_responses_part_breakpoint_reaches_a_model_that_takes_it_and_is_replayed(
        http: HttpDaemon, api: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    stub.enqueue("Noted.", "Fine.", "Plain.")
    part = {"type": "input_text", "text": "the long context", "prompt_cache_breakpoint": MARK}
    first = await api.responses.create(model=TAKES, instructions="be brief",
                                       input=[{"role": "user", "content": [part]}])  # type: ignore[list-item]
    body = stub.requests[-1]
    # the client's breakpoint on its block, and none of KSI's (the system prompt goes as it is)
    assert body["messages"][-1]["content"] == [{"type": "text", "text": "the long context",
                                                "prompt_cache_breakpoint": MARK}]
    assert marked(body) == [("user", "the long context")]
    record = await stored_response(http.daemon, ksi_id(first.id))
    assert record is not None and record[0]["prompt_cache_breakpoint"] == MARK
    assert first.conversation is not None
    conversation_id = first.conversation.id
    shown = await sent(http, conversation_id, 1)
    assert shown["breakpoints"] == [{"at": 1, "part": "input", "ttl": None, "by": "client"}]
    # the next turn replays it where it was: the prefix it closed is read from the cache
    second = await api.responses.create(model=TAKES, input="and then?", previous_response_id=first.id)
    assert marked(stub.requests[-1]) == [("user", "the long context")]
    assert stub.requests[-1]["messages"][-1]["content"] == "and then?"
    # a model that takes no explicit breakpoints is sent none
    await api.responses.create(model=PLAIN, input="last", previous_response_id=second.id)
    assert "prompt_cache_breakpoint" not in str(stub.requests[-1])
    # (instructions hold for their own response only, as OpenAI's do)
    assert [m["content"] for m in stub.requests[-1]["messages"]] == ["the long context", "Noted.", "and then?",
                                                                     "Fine.", "last"]
    assert (await sent(http, conversation_id, 3))["breakpoints"] == []


async def test_a_chat_part_breakpoint_reaches_a_model_that_takes_it_and_no_other(
        http: HttpDaemon, api: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    stub.enqueue("Noted.", "Fine.", "Plain.")
    asked: list[Any] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [
        {"type": "text", "text": "the long context"},
        {"type": "text", "text": "the question", "prompt_cache_breakpoint": MARK}]}]
    first = await api.chat.completions.with_raw_response.create(model=TAKES, messages=asked)
    # the message's text parts are kept as one: the breakpoint closes it
    assert marked(stub.requests[-1]) == [("user", "the long contextthe question")]
    conversation_id = first.headers["x-ksi-conversation-id"]
    assert (await sent(http, conversation_id, 1))["breakpoints"][0]["by"] == "client"
    # the client resends its history, the breakpoint where it put it: it goes out there again
    asked += [{"role": "assistant", "content": "Noted."}, {"role": "user", "content": "and then?"}]
    second = await api.chat.completions.with_raw_response.create(model=TAKES, messages=asked)
    assert second.headers["x-ksi-conversation-id"] == conversation_id
    assert marked(stub.requests[-1]) == [("user", "the long contextthe question")]
    assert (await sent(http, conversation_id, 2))["breakpoints"] == [
        {"at": 1, "part": "history", "ttl": None, "by": "client"}]
    asked += [{"role": "assistant", "content": "Fine."}, {"role": "user", "content": "last"}]
    await api.chat.completions.create(model=PLAIN, messages=asked)
    assert "prompt_cache_breakpoint" not in str(stub.requests[-1])
    assert [m["content"] for m in stub.requests[-1]["messages"]] == [
        "be brief", "the long contextthe question", "Noted.", "and then?", "Fine.", "last"]


@pytest.mark.parametrize("door", ["responses", "chat"])
@pytest.mark.parametrize("value", ["explicit", ["explicit"]])
async def test_a_breakpoint_that_is_not_an_object_is_refused_naming_it_and_nothing_is_written(
        http: HttpDaemon, api: openai.AsyncOpenAI, stub: StubOpenAI, door: str, value: Any) -> None:
    before = await stored_snapshot(http.daemon.settings)
    with pytest.raises(openai.BadRequestError) as caught:
        if door == "responses":
            await api.responses.create(model=TAKES, input=[{"role": "user", "content": [
                {"type": "input_text", "text": "hi", "prompt_cache_breakpoint": value}]}])  # type: ignore[list-item]
        else:
            await api.chat.completions.create(model=TAKES, messages=[{"role": "user", "content": [
                {"type": "text", "text": "hi", "prompt_cache_breakpoint": value}]}])  # type: ignore[list-item]
    assert caught.value.code == ErrorCode.VALIDATION_ERROR
    assert isinstance(caught.value.body, dict)
    where = "input" if door == "responses" else "messages"
    assert caught.value.body["param"] == f"{where}.0.content.0.prompt_cache_breakpoint"
    assert await stored_snapshot(http.daemon.settings) == before
    assert stub.requests == []


async def test_completion_async_names_a_breakpoint_that_is_not_an_object_in_its_input_and_history(
        http: HttpDaemon, stub: StubOpenAI) -> None:
    before = await stored_snapshot(http.daemon.settings)
    history = [{"role": "user", "content": "one", "prompt_cache_breakpoint": "explicit"},
               {"role": "assistant", "content": "two"}]
    asked = {"type": "message", "role": "user", "content": "three", "prompt_cache_breakpoint": ["explicit"]}
    async with connected(http.daemon) as client:
        for data, field in (({"input": [asked]}, "input.0.message.prompt_cache_breakpoint"),
                            ({"history": history, "prompt": "three"}, "history.0.prompt_cache_breakpoint")):
            with pytest.raises(KsiError) as refused:
                await client.request("completion:async", {**data, "model": TAKES})
            assert refused.value.code == ErrorCode.VALIDATION_ERROR
            assert field in refused.value.details["fields"], refused.value.details
    assert await stored_snapshot(http.daemon.settings) == before
    assert stub.requests == []
