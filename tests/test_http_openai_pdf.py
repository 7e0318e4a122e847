"""PDFs through the OpenAI door, sent with the official openai SDK: an `input_file` part on
/v1/responses and a `file` part on Chat Completions reach a model that reads PDFs as litellm's file
part, on their turn and again on the next (by previous_response_id and by a resent history, which
finds its conversation by the PDF's sha256). The record and the Conversations items name the PDF by
reference, and the turn is counted by its pages. A model that cannot read one, bad base64, a file that is not a PDF and a Files API id are
refused with their codes, naming the field, before anything is written."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest

from ksi_common.errors import ErrorCode
from ksi_common.pdf_pages import TOKENS_PER_PAGE
from tests.conftest import HttpDaemon, running_http_daemon, stub_settings
from tests.stored import stored_index, stored_response, stored_snapshot
from tests.stub_openai import StubOpenAI
from tests.test_http_messages import conversations
from tests.test_http_messages_documents import FILE_PART, PDF, PDF_DATA, PDF_MODEL, PDF_URL, SHA, TEXT_MODEL, blobs
from tests.test_http_openai import ksi_id

pytestmark = pytest.mark.backends

RESPONSES_PDF = {"type": "input_file", "file_data": PDF_URL, "filename": "report.pdf"}
CHAT_PDF = {"type": "file", "file": {"file_data": PDF_URL, "filename": "report.pdf"}}
STORED_REF = {"sha256": SHA, "media_type": "application/pdf", "bytes": len(PDF), "pages": 2, "name": "report.pdf"}


@pytest.fixture
async def http(short_tmp: Path, stub: StubOpenAI, backend: dict[str, Any]) -> AsyncIterator[HttpDaemon]:
    models = {PDF_MODEL: {"api_base": stub.api_base, "supports_pdf_input": True},
              TEXT_MODEL: {"api_base": stub.api_base, "supports_pdf_input": False}}
    async with running_http_daemon(short_tmp, **stub_settings(stub, models=models), **backend) as running:
        yield running


def user_turns(stub: StubOpenAI, index: int = -1) -> list[Any]:
    return [m["content"] for m in stub.requests[index]["messages"] if m["role"] == "user"]


FIRST_TURN = [{"type": "text", "text": "What changed?"}, FILE_PART]


async def test_a_responses_pdf_reaches_the_model_and_again_by_previous_response_id(
        http: HttpDaemon, api: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    stub.enqueue("It moved.", "May.")
    first = await api.responses.create(model=PDF_MODEL, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "What changed?"}, RESPONSES_PDF]}])
    assert user_turns(stub) == [FIRST_TURN]
    record = await stored_response(http.daemon, ksi_id(first.id))
    assert record is not None and PDF_DATA not in str(record)  # a reference, never the bytes
    assert record[0]["parts"][1] == {"type": "input_file", "file": STORED_REF}
    assert await blobs(http) == [SHA]
    await api.responses.create(model=PDF_MODEL, input="When?", previous_response_id=first.id)
    assert user_turns(stub) == [FIRST_TURN, "When?"]
    # the Conversations items name the PDF by its hash, never its bytes
    assert first.conversation is not None
    listed = await api.conversations.items.list(first.conversation.id, order="asc")
    parts = [part.model_dump(exclude_none=True) for item in listed.data if item.type == "message"
             for part in item.content if part.type == "input_file"]  # type: ignore[union-attr]
    assert parts == [{"type": "input_file", "file_id": f"sha256:{SHA}", "filename": "report.pdf"}]


async def test_a_responses_history_resending_the_pdf_finds_its_conversation(
        http: HttpDaemon, api: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    stub.enqueue("It moved.", "May.")
    # bare base64 is taken when the filename says PDF
    asked: list[Any] = [{"role": "user", "content": [
        {"type": "input_text", "text": "What changed?"}, {**RESPONSES_PDF, "file_data": PDF_DATA}]}]
    first = await api.responses.create(model=PDF_MODEL, input=asked)
    # the client keeps the items itself, without the ids KSI gave them, and resends them all
    asked += [{"role": "assistant", "content": first.output_text}, {"role": "user", "content": "When?"}]
    second = await api.responses.create(model=PDF_MODEL, input=asked)
    assert first.conversation is not None and second.conversation is not None
    assert second.conversation.id == first.conversation.id
    assert len(await stored_index(http.daemon, first.conversation.id)) == 2
    assert user_turns(stub) == [FIRST_TURN, "When?"]
    assert await blobs(http) == [SHA]


async def test_a_chat_pdf_reaches_the_model_and_a_resent_history_finds_its_conversation(
        http: HttpDaemon, api: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    stub.enqueue("It moved.", "May.")
    asked: list[Any] = [{"role": "user", "content": [{"type": "text", "text": "What changed?"}, CHAT_PDF]}]
    first = await api.chat.completions.with_raw_response.create(model=PDF_MODEL, messages=asked)
    assert user_turns(stub) == [FIRST_TURN]
    conversation_id = first.headers["x-ksi-conversation-id"]
    [line] = await stored_index(http.daemon, conversation_id)
    record = await stored_response(http.daemon, line["response_id"])
    assert record is not None and record[0]["parts"][1] == {"type": "input_file", "file": STORED_REF}
    assert line["tokens_in"] >= 2 * TOKENS_PER_PAGE  # the turn was counted with the PDF's two pages
    asked += [{"role": "assistant", "content": "It moved."}, {"role": "user", "content": "When?"}]
    second = await api.chat.completions.with_raw_response.create(model=PDF_MODEL, messages=asked)
    assert second.headers["x-ksi-conversation-id"] == conversation_id
    assert user_turns(stub) == [FIRST_TURN, "When?"]
    assert await conversations(http) == {conversation_id: 2}
    assert await blobs(http) == [SHA]


async def ask(api: openai.AsyncOpenAI, door: str, part: dict[str, Any], model: str = PDF_MODEL) -> None:
    """One turn holding `part` (in the door's own form) after a text part."""
    if door == "responses":
        await api.responses.create(model=model, input=[{"role": "user", "content": [
            {"type": "input_text", "text": "What is this?"}, part]}])  # type: ignore[list-item]
    else:
        await api.chat.completions.create(model=model, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"}, part]}])  # type: ignore[list-item]


def door_part(door: str, **fields: Any) -> dict[str, Any]:
    return {"type": "input_file", **fields} if door == "responses" else {"type": "file", "file": fields}


NOT_A_PDF = base64.b64encode(b"hello, not a PDF").decode()


@pytest.mark.parametrize("door", ["responses", "chat"])
@pytest.mark.parametrize(("fields", "code", "field"), [
    ({"file_data": PDF_URL, "filename": "report.pdf"}, ErrorCode.UNSUPPORTED_PARAMETER, ""),  # to TEXT_MODEL
    ({"file_data": "data:application/pdf;base64,not*base64"}, ErrorCode.VALIDATION_ERROR, ".file_data"),
    ({"file_data": f"data:application/pdf;base64,{NOT_A_PDF}"}, ErrorCode.VALIDATION_ERROR, ".file_data"),
    ({"file_data": f"data:text/plain;base64,{NOT_A_PDF}"}, ErrorCode.UNSUPPORTED_MEDIA_TYPE, ".file_data"),
    ({"file_data": NOT_A_PDF, "filename": "notes.txt"}, ErrorCode.UNSUPPORTED_MEDIA_TYPE, ".file_data"),
    ({"file_data": NOT_A_PDF}, ErrorCode.VALIDATION_ERROR, ".file_data"),
    ({"file_id": "file-123"}, ErrorCode.UNSUPPORTED_PARAMETER, ".file_id"),
])
async def test_refused_pdf_parts_name_their_field_and_write_nothing(
        http: HttpDaemon, api: openai.AsyncOpenAI, stub: StubOpenAI, door: str, fields: dict[str, Any], code: str,
        field: str) -> None:
    before = await stored_snapshot(http.daemon.settings)
    model = TEXT_MODEL if code == ErrorCode.UNSUPPORTED_PARAMETER and not field else PDF_MODEL
    with pytest.raises(openai.APIStatusError) as caught:
        await ask(api, door, door_part(door, **fields), model)
    assert caught.value.code == code
    assert caught.value.status_code == (415 if code == ErrorCode.UNSUPPORTED_MEDIA_TYPE else 400)
    assert isinstance(caught.value.body, dict)
    nested = ".file" if door == "chat" and field else ""  # Chat Completions nests the file's fields
    assert caught.value.body["param"] == ("input" if door == "responses" else "messages") + ".0.content.1" \
        + nested + field
    assert await stored_snapshot(http.daemon.settings) == before
    assert stub.requests == [] and await blobs(http) == []


async def test_file_url_a_rendering_detail_and_audio_stay_refused(http: HttpDaemon, api: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await ask(api, "responses", {"type": "input_file", "file_url": "https://example.org/report.pdf"})
    assert caught.value.code == ErrorCode.UNSUPPORTED_PARAMETER
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "input.0.content.1.file_url"
    with pytest.raises(openai.BadRequestError) as caught:
        await ask(api, "responses", {**RESPONSES_PDF, "detail": "low"})
    assert caught.value.code == ErrorCode.UNSUPPORTED_PARAMETER
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "input.0.content.1.detail"
    with pytest.raises(openai.BadRequestError) as caught:
        await ask(api, "chat", {"type": "input_audio", "input_audio": {"data": NOT_A_PDF, "format": "wav"}})
    assert caught.value.code == ErrorCode.UNSUPPORTED_PARAMETER
    assert stub.requests == []
