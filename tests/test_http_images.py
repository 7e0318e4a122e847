"""Images through the OpenAI door, sent with the official openai SDK: `input_image` parts on
/v1/responses and `image_url` parts on chat completions (a data URL, an https URL) reach a vision
model through real litellm and the stub; the record holds a reference, never the bytes; a model
declared without vision refuses them (`unsupported_parameter`) before anything is written."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest

from ksi_common.errors import ErrorCode
from tests.conftest import HttpDaemon, running_http_daemon, stub_settings
from tests.image_bytes import png
from tests.stored import stored_index, stored_response, stored_snapshot
from tests.stub_openai import StubOpenAI
from tests.test_http_openai import ksi_id, sdk
from tests.test_image_files import blob_files, data_url, vision_models

IMAGE = png(32, 32, shade=7)
IMAGE_URL = data_url(IMAGE, "image/png")
CAT = "https://example.org/cat.png"


@pytest.fixture
async def vision_http(short_tmp: Path, stub: StubOpenAI) -> AsyncIterator[HttpDaemon]:
    async with running_http_daemon(short_tmp, **stub_settings(stub, **vision_models(stub))) as running:
        yield running


@pytest.fixture
async def client(vision_http: HttpDaemon) -> AsyncIterator[openai.AsyncOpenAI]:
    async with sdk(vision_http) as api:
        yield api


def image_parts_sent(stub: StubOpenAI, index: int = -1) -> list[dict[str, Any]]:
    """The image parts of the last user message the stub received."""
    user = [m for m in stub.messages(index) if m["role"] == "user"][-1]
    return [part for part in user["content"] if part["type"] == "image_url"]


async def test_response_input_images_reach_a_vision_model_and_are_stored_by_reference(
        vision_http: HttpDaemon, client: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    stub.enqueue("a grey square and a cat")
    response = await client.responses.create(model="openai/stub-vision", input=[{"role": "user", "content": [
        {"type": "input_text", "text": "What are these?"},
        {"type": "input_image", "image_url": IMAGE_URL, "detail": "low"},
        {"type": "input_image", "image_url": CAT, "detail": "auto"}]}])
    assert response.output_text == "a grey square and a cat"
    user = [m for m in stub.messages() if m["role"] == "user"][-1]
    assert user["content"][0] == {"type": "text", "text": "What are these?"}
    assert image_parts_sent(stub) == [{"type": "image_url", "image_url": {"url": IMAGE_URL, "detail": "low"}},
                                      {"type": "image_url", "image_url": {"url": CAT, "detail": "auto"}}]
    record = await stored_response(vision_http.daemon, ksi_id(response.id))
    assert record is not None
    first = record[0]
    assert first["content"] == "What are these?"
    assert first["parts"][1]["image"]["sha256"] == hashlib.sha256(IMAGE).hexdigest()
    assert first["parts"][2]["image"] == {"url": CAT, "detail": "auto"}
    assert "base64" not in str(record)  # a reference, never the bytes
    assert [p.name for p in blob_files(vision_http.daemon.layout.root)] == [hashlib.sha256(IMAGE).hexdigest()]
    # a later turn by id sends the image again, from storage
    await client.responses.create(input="And the colour?", previous_response_id=response.id)
    assert stub.messages()[-1] == {"role": "user", "content": "And the colour?"}
    history_user = [m for m in stub.messages() if m["role"] == "user"][0]
    assert {"type": "image_url", "image_url": {"url": IMAGE_URL, "detail": "low"}} in history_user["content"]


async def test_chat_image_url_parts_reach_a_vision_model_and_a_resent_history_finds_its_conversation(
        vision_http: HttpDaemon, client: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    stub.enqueue("a grey square", "grey, mostly")
    asked: list[Any] = [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": IMAGE_URL}}]}]
    first = await client.chat.completions.create(model="openai/stub-vision", messages=asked)
    assert first.choices[0].message.content == "a grey square"
    assert image_parts_sent(stub) == [{"type": "image_url", "image_url": {"url": IMAGE_URL}}]
    # the client resends everything, its image included: the same conversation, one more exchange
    asked += [{"role": "assistant", "content": "a grey square"}, {"role": "user", "content": "Which grey?"}]
    second = await client.chat.completions.with_raw_response.create(model="openai/stub-vision", messages=asked)
    conversation = second.headers["X-KSI-Conversation-Id"]
    assert second.parse().choices[0].message.content == "grey, mostly"
    index = await stored_index(vision_http.daemon, conversation)
    assert len(index) == 2
    record = await stored_response(vision_http.daemon, index[0]["response_id"])
    assert record is not None and record[0]["parts"][1]["image"]["sha256"] == hashlib.sha256(IMAGE).hexdigest()
    assert "base64" not in str(record)
    assert len(blob_files(vision_http.daemon.layout.root)) == 1


async def test_a_chat_https_image_url_is_passed_as_a_url(client: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    await client.chat.completions.create(model="openai/stub-vision", messages=[{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": CAT, "detail": "high"}}]}])
    assert image_parts_sent(stub) == [{"type": "image_url", "image_url": {"url": CAT, "detail": "high"}}]


@pytest.mark.parametrize("api", ["responses", "chat"])
async def test_images_to_a_model_without_vision_are_refused_and_nothing_is_written(
        vision_http: HttpDaemon, client: openai.AsyncOpenAI, stub: StubOpenAI, api: str) -> None:
    before = await stored_snapshot(vision_http.daemon.settings)
    with pytest.raises(openai.BadRequestError) as caught:
        if api == "responses":
            await client.responses.create(model="openai/stub-text", input=[{"role": "user", "content": [
                {"type": "input_text", "text": "What is this?"}, {"type": "input_image", "image_url": IMAGE_URL}]}])
        else:
            await client.chat.completions.create(model="openai/stub-text", messages=[{"role": "user", "content": [
                {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": IMAGE_URL}}]}])
    assert caught.value.code == ErrorCode.UNSUPPORTED_PARAMETER
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["param"] == ("input" if api == "responses" else "messages") + ".0.content.1"
    assert await stored_snapshot(vision_http.daemon.settings) == before
    assert stub.requests == [] and blob_files(vision_http.daemon.layout.root) == []


@pytest.mark.parametrize("api", ["responses", "chat"])
async def test_a_refused_image_after_a_history_is_named_where_the_client_put_it(
        vision_http: HttpDaemon, client: openai.AsyncOpenAI, stub: StubOpenAI, api: str) -> None:
    history: list[Any] = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi."}]
    with pytest.raises(openai.BadRequestError) as caught:
        if api == "responses":
            await client.responses.create(model="openai/stub-text", input=[*history, {"role": "user", "content": [
                {"type": "input_text", "text": "What is this?"}, {"type": "input_image", "image_url": CAT}]}])
        else:
            await client.chat.completions.create(model="openai/stub-text", messages=[*history, {
                "role": "user", "content": [{"type": "text", "text": "What is this?"},
                                            {"type": "image_url", "image_url": {"url": CAT}}]}])
    assert caught.value.code == ErrorCode.UNSUPPORTED_PARAMETER
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["param"] == ("input" if api == "responses" else "messages") + ".2.content.1"
    assert stub.requests == []


@pytest.mark.parametrize(("part", "status", "code"), [
    ({"type": "input_image", "image_url": "http://example.org/cat.png"}, 400, ErrorCode.VALIDATION_ERROR),
    ({"type": "input_image", "file_id": "file-123"}, 400, ErrorCode.UNSUPPORTED_PARAMETER),
    ({"type": "input_image", "image_url": "data:text/plain;base64,aGVsbG8="}, 415, ErrorCode.UNSUPPORTED_MEDIA_TYPE),
    ({"type": "input_file", "file_data": "aGVsbG8="}, 400, ErrorCode.VALIDATION_ERROR),  # no type, no filename
    ({"type": "input_file", "file_data": "data:text/csv;base64,aGVsbG8="}, 415, ErrorCode.UNSUPPORTED_MEDIA_TYPE),
])
async def test_bad_image_parts_are_refused_with_their_codes(
        vision_http: HttpDaemon, client: openai.AsyncOpenAI, stub: StubOpenAI, part: dict[str, Any], status: int,
        code: str) -> None:
    before = await stored_snapshot(vision_http.daemon.settings)
    with pytest.raises(openai.APIStatusError) as caught:
        await client.responses.create(model="openai/stub-vision", input=[{"role": "user", "content": [
            {"type": "input_text", "text": "What is this?"}, part]}])  # type: ignore[list-item]
    assert (caught.value.status_code, caught.value.code) == (status, code)
    assert await stored_snapshot(vision_http.daemon.settings) == before
    assert stub.requests == [] and blob_files(vision_http.daemon.layout.root) == []


async def test_a_refused_image_url_is_explained_in_the_clients_words(client: openai.AsyncOpenAI) -> None:
    """The field names are put in Responses terms (`data` -> `input`), the sentence's words are not."""
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(model="openai/stub-vision", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "http://example.org/cat.png"}]}])
    assert isinstance(caught.value.body, dict)
    message = caught.value.body["message"]
    assert "or a data: URL" in message and "input: URL" not in message, message
    assert caught.value.body["param"].startswith("input.0.content.0")


async def test_a_responses_history_resending_an_https_image_finds_its_conversation(
        vision_http: HttpDaemon, client: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    stub.enqueue("a cat", "grey")
    asked: list[Any] = [{"role": "user", "content": [
        {"type": "input_text", "text": "What is this?"}, {"type": "input_image", "image_url": CAT}]}]
    first = await client.responses.create(model="openai/stub-vision", input=asked)
    # the client keeps the items itself, without the ids KSI gave them, and resends them all
    asked += [{"role": "assistant", "content": first.output_text}, {"role": "user", "content": "What colour?"}]
    second = await client.responses.create(model="openai/stub-vision", input=asked)
    assert second.output_text == "grey"
    assert first.conversation is not None and second.conversation is not None
    assert second.conversation.id == first.conversation.id
    assert len(await stored_index(vision_http.daemon, first.conversation.id)) == 2
