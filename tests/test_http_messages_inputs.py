"""What the Messages door refuses and what else it takes, with the official `anthropic` SDK: bad
requests answered in Anthropic's error shape with KSI's code inside and nothing written (missing
max_tokens, a tool_result answering no tool_use, an unknown model naming the closest, a wrong
key, server tools, a prefilled answer, a body too large); images as base64 and URL blocks, stored
by reference; count_tokens; a model alias pointing a vendor's name at a local model."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from tests.conftest import HttpDaemon, running_http_daemon, stub_settings
from tests.image_bytes import png
from tests.stored import stored_index, stored_response, stored_snapshot
from tests.stub_openai import StubOpenAI
from tests.test_http_messages import MODEL, conversations, sdk
from tests.test_http_messages_tools import WEATHER
from tests.test_image_files import blob_files, vision_models

IMAGE = png(32, 32, shade=9)
CAT = "https://example.org/cat.png"


@pytest.fixture
async def http(short_tmp: Path, stub: StubOpenAI) -> AsyncIterator[HttpDaemon]:
    settings = stub_settings(stub, **vision_models(stub), model_aliases={"claude-sonnet-*": "openai/stub-model"},
                             line_limit=64 * 1024)
    async with running_http_daemon(short_tmp, **settings) as running:
        yield running


@pytest.fixture
async def client(http: HttpDaemon) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with sdk(http) as api:
        yield api


ASK: Any = [{"role": "user", "content": "hi"}]
REFUSED: list[tuple[str, dict[str, Any], int, str, str]] = [
    # (what, body, status, KSI code, the field it names)
    ("no max_tokens", {"model": MODEL, "messages": ASK}, 400, "validation_error", "max_tokens"),
    ("a result with no call", {"model": MODEL, "max_tokens": 10, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "12C"}]}]},
     400, "validation_error", "messages.0.content"),
    ("a call left unanswered", {"model": MODEL, "max_tokens": 10, "tools": [WEATHER], "messages": [
        *ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_a", "name": "weather",
                                                 "input": {"city": "Oslo"}}]},
        {"role": "user", "content": "and?"}]}, 400, "validation_error", "messages.2.content"),
    ("a server tool", {"model": MODEL, "max_tokens": 10, "messages": ASK,
                       "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     400, "unsupported_parameter", "tools.0.type"),
    ("a prefilled answer", {"model": MODEL, "max_tokens": 10, "messages": [
        *ASK, {"role": "assistant", "content": "Sure,"}]}, 400, "unsupported_parameter", "messages.1.role"),
    ("a document of the Files API", {"model": MODEL, "max_tokens": 10, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "file", "file_id": "file_011"}}]}]},
     400, "unsupported_parameter", "messages.0.content.0.source.type"),
    ("too many stop sequences", {"model": MODEL, "max_tokens": 10, "messages": ASK,
                                 "stop_sequences": ["a", "b", "c", "d", "e"]},
     400, "validation_error", "stop_sequences"),
]


@pytest.mark.parametrize(("what", "body", "status", "code", "field"), REFUSED, ids=[r[0] for r in REFUSED])
async def test_bad_requests_are_refused_in_anthropics_shape_and_nothing_is_written(
        http: HttpDaemon, client: anthropic.AsyncAnthropic, stub: StubOpenAI,
        what: str, body: dict[str, Any], status: int, code: str, field: str) -> None:
    before = await stored_snapshot(http.daemon.settings)
    with pytest.raises(anthropic.APIStatusError) as refused:
        await client.post("/v1/messages", body=body, cast_to=httpx.Response)
    error = refused.value
    assert error.status_code == status and isinstance(error.body, dict)
    assert error.body["type"] == "error" and error.body["error"]["type"] == "invalid_request_error"
    assert error.body["error"]["code"] == code
    assert field in error.body["error"]["details"]["fields"], error.body
    assert error.response.headers["x-should-retry"] == "false"
    assert await stored_snapshot(http.daemon.settings) == before
    assert stub.requests == []


async def test_an_unknown_model_names_the_closest(http: HttpDaemon, client: anthropic.AsyncAnthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as refused:
        await client.messages.create(model="stub-modle", max_tokens=10, messages=ASK)
    assert isinstance(refused.value.body, dict)
    error = refused.value.body["error"]
    assert (error["type"], error["code"]) == ("not_found_error", "model_not_found")
    assert "openai/stub-model" in error["details"]["suggestions"]
    assert await conversations(http) == {}


async def test_a_model_without_its_key_is_not_retried(http: HttpDaemon, client: anthropic.AsyncAnthropic) -> None:
    with pytest.raises(anthropic.APIStatusError) as refused:
        await client.messages.create(model="anthropic/claude-no-key", max_tokens=10, messages=ASK)
    assert refused.value.status_code == 503 and refused.value.response.headers["x-should-retry"] == "false"
    assert refused.value.body["error"]["code"] == "api_key_missing"  # type: ignore[index]
    assert await conversations(http) == {}


async def test_a_wrong_key_is_refused_in_anthropics_shape(http: HttpDaemon) -> None:
    async with sdk(http, key="not-the-token-0123456789") as wrong:
        with pytest.raises(anthropic.AuthenticationError) as refused:
            await wrong.messages.create(model=MODEL, max_tokens=10, messages=ASK)
    assert refused.value.body == {"type": "error", "error": {
        "type": "authentication_error", "message": refused.value.body["error"]["message"],  # type: ignore[index]
        "code": "unauthorized"}}
    async with anthropic.AsyncAnthropic(base_url=http.base_url, auth_token=http.token, max_retries=0) as bearer:
        assert (await bearer.messages.create(model=MODEL, max_tokens=10, messages=ASK)).content
    assert len(await conversations(http)) == 1


async def test_a_body_past_the_limit_is_413(http: HttpDaemon, client: anthropic.AsyncAnthropic) -> None:
    with pytest.raises(anthropic.APIStatusError) as refused:
        await client.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "x" * 70_000}])
    assert refused.value.status_code == 413
    assert refused.value.body["error"]["type"] == "request_too_large"  # type: ignore[index]
    assert await conversations(http) == {}


async def test_images_as_base64_and_url_are_stored_by_reference(
        http: HttpDaemon, client: anthropic.AsyncAnthropic, stub: StubOpenAI) -> None:
    data = base64.b64encode(IMAGE).decode()
    asked: Any = [{"role": "user", "content": [
        {"type": "text", "text": "What are these?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
        {"type": "image", "source": {"type": "url", "url": CAT}}]}]
    stub.enqueue("a square and a cat", "grey")
    first = await client.messages.with_raw_response.create(model="openai/stub-vision", max_tokens=20, messages=asked)
    user = [m for m in stub.messages() if m["role"] == "user"][-1]
    assert user["content"] == [{"type": "text", "text": "What are these?"},
                               {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
                               {"type": "image_url", "image_url": {"url": CAT}}]
    conversation_id = first.headers["x-ksi-conversation-id"]
    [line] = await stored_index(http.daemon, conversation_id)
    record = await stored_response(http.daemon, line["response_id"])
    assert record is not None and data not in str(record)  # a reference, never the bytes
    assert record[0]["parts"][1]["image"]["sha256"] == hashlib.sha256(IMAGE).hexdigest()
    assert record[0]["parts"][2]["image"] == {"url": CAT}
    assert [p.name for p in blob_files(http.daemon.layout.root)] == [hashlib.sha256(IMAGE).hexdigest()]
    # the session resends its image: the same conversation
    asked += [{"role": "assistant", "content": "a square and a cat"}, {"role": "user", "content": "colour?"}]
    second = await client.messages.with_raw_response.create(model="openai/stub-vision", max_tokens=20, messages=asked)
    assert second.headers["x-ksi-conversation-id"] == conversation_id
    assert len(await stored_index(http.daemon, conversation_id)) == 2


async def test_count_tokens_calls_no_provider_and_writes_nothing(
        http: HttpDaemon, client: anthropic.AsyncAnthropic, stub: StubOpenAI) -> None:
    before = await stored_snapshot(http.daemon.settings)
    short = await client.messages.count_tokens(model=MODEL, messages=ASK)
    longer = await client.messages.count_tokens(model=MODEL, system="You are terse. " * 20, tools=[WEATHER],
                                                messages=[{"role": "user", "content": "hello there " * 50}])
    assert 0 < short.input_tokens < longer.input_tokens
    with pytest.raises(anthropic.BadRequestError) as refused:
        await client.messages.count_tokens(model=MODEL, messages=[{"role": "assistant", "content": "x"}])
    assert refused.value.body["error"]["code"] == "unsupported_parameter"  # type: ignore[index]
    assert stub.requests == [] and await stored_snapshot(http.daemon.settings) == before


async def test_an_alias_points_a_vendor_name_at_a_local_model(
        http: HttpDaemon, client: anthropic.AsyncAnthropic, stub: StubOpenAI) -> None:
    reply = await client.messages.create(model="claude-sonnet-4-5", max_tokens=10, messages=ASK)
    assert reply.model == "claude-sonnet-4-5" and reply.content[0].text == "stub answer to: hi"  # type: ignore[union-attr]
    assert stub.requests[-1]["model"] == "stub-model"


async def test_thinking_goes_only_to_a_model_called_through_anthropic(
        http: HttpDaemon, client: anthropic.AsyncAnthropic, stub: StubOpenAI) -> None:
    """Claude Code asks for thinking on every turn: a model that cannot take it answers without it,
    and the answer says the field was not sent."""
    raw = await client.messages.with_raw_response.create(
        model=MODEL, max_tokens=2000, thinking={"type": "enabled", "budget_tokens": 1024}, messages=ASK)
    assert raw.headers["x-ksi-unsent"] == "thinking" and "thinking" not in stub.requests[-1]
    quiet = await client.messages.with_raw_response.create(model=MODEL, max_tokens=20, messages=ASK)
    assert "x-ksi-unsent" not in quiet.headers


async def test_sampling_fields_tool_choice_and_system_blocks_reach_the_provider(
        client: anthropic.AsyncAnthropic, stub: StubOpenAI) -> None:
    await client.messages.create(
        # this SDK version has no sampling parameters of its own: sent as older clients send them
        model=MODEL, max_tokens=30, extra_body={"temperature": 0.2, "top_p": 0.9, "top_k": 5}, stop_sequences=["END"],
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Use metric units."}],
        tools=[WEATHER], tool_choice={"type": "tool", "name": "weather", "disable_parallel_tool_use": True},
        messages=ASK)
    sent = stub.requests[-1]
    assert (sent["temperature"], sent["top_p"], sent["top_k"], sent["stop"]) == (0.2, 0.9, 5, ["END"])
    assert sent["max_tokens"] == 30 and sent["parallel_tool_calls"] is False
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert sent["messages"][0] == {"role": "system", "content": "Be brief.\n\nUse metric units."}
    await client.messages.create(model=MODEL, max_tokens=30, tools=[WEATHER], tool_choice={"type": "any"},
                                 messages=ASK)
    assert stub.requests[-1]["tool_choice"] == "required"
