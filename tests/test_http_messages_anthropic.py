"""What the Messages door passes on to models called through Anthropic's API and to no other:
the client's `anthropic-beta` header and its `cache_control` breakpoints; a PDF document arrives
there as a document block. The provider is the cache emulator, which answers both Anthropic's
Messages shape and chat completions, reached through real litellm; the client is
the official `anthropic` SDK."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import pytest

from tests.cache_emulator import MINIMUM, CacheEmulator
from tests.conftest import HttpDaemon, running_http_daemon
from tests.image_bytes import png
from tests.stored import stored_response, stored_snapshot
from tests.test_http_messages import conversations, sdk
from tests.test_http_messages_documents import PDF_DATA

pytestmark = pytest.mark.backends

ANTHROPIC_MODEL = "anthropic/emulated"
OPENAI_MODEL = "openai/emulated"
BETA = ["fine-grained-tool-streaming-2025-05-14", "interleaved-thinking-2025-05-14"]


@pytest.fixture
async def emulator() -> AsyncIterator[CacheEmulator]:
    async with CacheEmulator() as running:
        yield running


@pytest.fixture
async def http(short_tmp: Path, emulator: CacheEmulator, backend: dict[str, Any],
               monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[HttpDaemon]:
    monkeypatch.setenv("EMULATOR_KEY", "sk-ant-local")
    models = {ANTHROPIC_MODEL: {"api_base": emulator.api_base.removesuffix("/v1"), "api_key_env": "EMULATOR_KEY"},
              OPENAI_MODEL: {"api_base": emulator.api_base}}
    async with running_http_daemon(short_tmp, models=models, default_model=OPENAI_MODEL, summariser="off",
                                   **backend) as running:
        yield running


def betas(headers: dict[str, str]) -> list[str]:
    return [name.strip() for name in headers.get("anthropic-beta", "").split(",") if name.strip()]


async def test_anthropic_beta_reaches_anthropic_models_only(http: HttpDaemon, emulator: CacheEmulator) -> None:
    async with sdk(http) as client:
        for model in (ANTHROPIC_MODEL, OPENAI_MODEL):
            await client.messages.create(model=model, max_tokens=20, messages=[{"role": "user", "content": "hi"}],
                                         extra_headers={"anthropic-beta": ",".join(BETA)})
        await client.messages.create(model=ANTHROPIC_MODEL, max_tokens=20,
                                     messages=[{"role": "user", "content": "no beta"}])
    to_anthropic, to_openai, without = emulator.headers
    assert set(BETA) <= set(betas(to_anthropic))
    assert "anthropic-beta" not in {name.lower() for name in to_openai}
    assert not set(BETA) & set(betas(without))


async def test_a_beta_name_that_could_end_the_header_is_refused_and_nothing_is_written(
        http: HttpDaemon, emulator: CacheEmulator) -> None:
    before = await stored_snapshot(http.daemon.settings)
    async with sdk(http) as client:
        with pytest.raises(anthropic.BadRequestError) as refused:
            await client.messages.create(model=ANTHROPIC_MODEL, max_tokens=20,
                                         messages=[{"role": "user", "content": "hi"}],
                                         extra_headers={"anthropic-beta": "ok-1, bad name;x=1"})
    body: Any = refused.value.body
    assert body["error"]["code"] == "validation_error"
    assert "anthropic-beta" in body["error"]["message"]
    assert emulator.headers == [] and await conversations(http) == {}
    assert await stored_snapshot(http.daemon.settings) == before


SYSTEM = " ".join(f"rule{i}" for i in range(MINIMUM + 200))  # long enough to be cached
MARK = {"type": "ephemeral"}


def marked_text(text: str) -> list[dict[str, Any]]:
    """A user turn as Claude Code sends its newest: a text block carrying the client's breakpoint."""
    return [{"type": "text", "text": text, "cache_control": MARK}]


def client_markers(body: dict[str, Any]) -> list[tuple[str, str]]:
    """Each block a Messages request marks, as (role, its text)."""
    return [(message["role"], block.get("text", "")) for message in body["messages"]
            if isinstance(message["content"], list) for block in message["content"] if "cache_control" in block]


async def test_a_clients_cache_control_is_stored_and_sent_to_anthropic_models_where_it_put_it(
        http: HttpDaemon, emulator: CacheEmulator) -> None:
    first = [{"role": "user", "content": marked_text("first question")}]
    async with sdk(http) as client:
        answer = await client.messages.with_raw_response.create(model=ANTHROPIC_MODEL, max_tokens=20, system=SYSTEM,
                                                                messages=first)
        reply = await answer.parse()
        second = [{"role": "user", "content": [{"type": "text", "text": "first question"}]},
                  {"role": "assistant", "content": reply.content[0].text},  # type: ignore[union-attr]
                  {"role": "user", "content": marked_text("second question")}]
        await client.messages.create(model=ANTHROPIC_MODEL, max_tokens=20, system=SYSTEM, messages=second)
    sent = emulator.anthropic_requests
    assert client_markers(sent[0]) == [("user", "first question")]
    assert client_markers(sent[1])[-1] == ("user", "second question")  # KSI placed none of its own
    assert not any("cache_control" in block for block in sent[1].get("system") or [])
    assert [u["cache_read_input_tokens"] for u in emulator.anthropic_usages][1] > MINIMUM
    assert await conversations(http) == {answer.headers["x-ksi-conversation-id"]: 2}
    lines = await stored_response(http.daemon, answer.headers["request-id"])
    assert lines is not None
    assert [line.get("cache_control") for line in lines if line["type"] == "user"] == [MARK]


async def test_a_clients_cache_control_is_left_out_of_what_other_providers_are_sent(
        http: HttpDaemon, emulator: CacheEmulator) -> None:
    async with sdk(http) as client:
        reply = await client.messages.create(model=OPENAI_MODEL, max_tokens=20,
                                             messages=[{"role": "user", "content": marked_text("hi")}])
    assert reply.content[0].text == "answer 1"  # type: ignore[union-attr]
    assert "cache_control" not in str(emulator.requests[0])


async def test_a_marker_on_a_turn_with_an_image_reaches_anthropic_on_its_last_block(
        http: HttpDaemon, emulator: CacheEmulator) -> None:
    image = {"type": "image", "cache_control": MARK,
             "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png(8, 8)).decode()}}
    async with sdk(http) as client:
        await client.messages.create(model=ANTHROPIC_MODEL, max_tokens=20, messages=[
            {"role": "user", "content": [{"type": "text", "text": "what is this"}, image]}])
    (turn,) = emulator.anthropic_requests[0]["messages"]
    assert [block["type"] for block in turn["content"]] == ["text", "image"]
    assert [block.get("cache_control") for block in turn["content"]] == [None, MARK]


async def test_a_cache_control_of_no_known_kind_is_refused_and_nothing_is_written(
        http: HttpDaemon, emulator: CacheEmulator) -> None:
    before = await stored_snapshot(http.daemon.settings)
    async with sdk(http) as client:
        with pytest.raises(anthropic.BadRequestError) as refused:
            await client.messages.create(model=ANTHROPIC_MODEL, max_tokens=20, messages=[{"role": "user", "content": [
                {"type": "text", "text": "hi", "cache_control": {"type": "forever"}}]}])
    body: Any = refused.value.body
    assert body["error"]["code"] == "validation_error"
    assert "cache_control" in body["error"]["message"]
    assert emulator.anthropic_requests == [] and await conversations(http) == {}
    assert await stored_snapshot(http.daemon.settings) == before


async def test_a_pdf_reaches_anthropic_as_a_document_block_on_its_turn_and_the_next(
        http: HttpDaemon, emulator: CacheEmulator) -> None:
    pdf = {"type": "document", "title": "report.pdf",
           "source": {"type": "base64", "media_type": "application/pdf", "data": PDF_DATA}}
    asked: Any = [{"role": "user", "content": [pdf, {"type": "text", "text": "what is this"}]}]
    async with sdk(http) as client:
        reply = await client.messages.create(model=ANTHROPIC_MODEL, max_tokens=20, messages=asked)
        asked += [{"role": "assistant", "content": reply.content[0].text},  # type: ignore[union-attr]
                  {"role": "user", "content": "and?"}]
        await client.messages.create(model=ANTHROPIC_MODEL, max_tokens=20, messages=asked)
    for sent in emulator.anthropic_requests:
        documents = [block for block in sent["messages"][0]["content"] if block["type"] == "document"]
        assert [document["source"] for document in documents] == [
            {"type": "base64", "media_type": "application/pdf", "data": PDF_DATA}]
    assert list((await conversations(http)).values()) == [2]
