"""`document` blocks on the Messages door, with the official `anthropic` SDK: a base64 PDF is stored
by reference (as an image is) and reaches a model that reads PDFs as litellm's file part, on its
turn and again from the blob store when the history is resent; a plain-text document reaches every
model as text under its title. A PDF for a model that cannot read one, bad base64 and a wrong media
type are refused with nothing written. A PDF inside a tool's result reaches the model too.
Transcripts, `conversation:sent` and an export name the PDF by its label, never its bytes, and the
export imports again."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import orjson
import pytest

from ksi_common.events import CONVERSATION_EXPORT, CONVERSATION_IMPORT, CONVERSATION_SENT, CONVERSATION_SHOW
from ksi_common.pdf_pages import TOKENS_PER_PAGE
from ksi_daemon.context import EventContext
from tests.conftest import HttpDaemon, running_http_daemon, stub_settings
from tests.stored import stored_index, stored_response, stored_snapshot
from tests.stub_openai import Reply, StubOpenAI
from tests.test_http_messages import conversations, sdk

pytestmark = pytest.mark.backends

PDF_MODEL = "openai/stub-pdf"
TEXT_MODEL = "openai/stub-text"
PDF = (b"%PDF-1.4\n1 0 obj << /Type /Catalog /Pages 2 0 R >> endobj\n"
       b"2 0 obj << /Type /Pages /Kids [3 0 R 4 0 R] /Count 2 >> endobj\n"
       b"3 0 obj << /Type /Page /Parent 2 0 R >> endobj\n4 0 obj << /Type /Page /Parent 2 0 R >> endobj\n"
       b"trailer << /Root 1 0 R >>\n%%EOF\n")
PDF_DATA = base64.b64encode(PDF).decode()
PDF_URL = f"data:application/pdf;base64,{PDF_DATA}"
SHA = hashlib.sha256(PDF).hexdigest()


def pdf_block(data: str = PDF_DATA, media_type: str = "application/pdf") -> dict[str, Any]:
    return {"type": "document", "title": "report.pdf",
            "source": {"type": "base64", "media_type": media_type, "data": data}}


NOTES = {"type": "document", "title": "Notes", "source": {"type": "text", "media_type": "text/plain",
                                                           "data": "The launch moved to May."}}


@pytest.fixture
async def http(short_tmp: Path, stub: StubOpenAI, backend: dict[str, Any]) -> AsyncIterator[HttpDaemon]:
    models = {PDF_MODEL: {"api_base": stub.api_base, "supports_pdf_input": True},
              TEXT_MODEL: {"api_base": stub.api_base, "supports_pdf_input": False}}
    # no summariser: a PDF's pages fill the stub's window, and a summary call would come between
    # the turns whose requests these tests read
    async with running_http_daemon(short_tmp, **stub_settings(stub, models=models), summariser="off",
                                   **backend) as running:
        yield running


async def blobs(http: HttpDaemon) -> list[str]:
    return sorted(await http.daemon.storage.blobs.ids())


@pytest.fixture
async def client(http: HttpDaemon) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with sdk(http) as api:
        yield api


def user_turns(stub: StubOpenAI, index: int = -1) -> list[Any]:
    return [m["content"] for m in stub.requests[index]["messages"] if m["role"] == "user"]


FILE_PART = {"type": "file", "file": {"file_data": PDF_URL, "filename": "report.pdf"}}
FIRST_TEXT = "What changed?\n[document Notes]\nThe launch moved to May."


async def test_a_pdf_and_a_text_document_reach_the_model_on_their_turn_and_again_from_storage(
        http: HttpDaemon, client: anthropic.AsyncAnthropic, stub: StubOpenAI) -> None:
    asked: Any = [{"role": "user", "content": [pdf_block(), {"type": "text", "text": "What changed?"}, NOTES]}]
    stub.enqueue("It moved.", "May.")
    first = await client.messages.with_raw_response.create(model=PDF_MODEL, max_tokens=20, messages=asked)
    assert user_turns(stub) == [[{"type": "text", "text": FIRST_TEXT}, FILE_PART]]
    conversation_id = first.headers["x-ksi-conversation-id"]
    [line] = await stored_index(http.daemon, conversation_id)
    record = await stored_response(http.daemon, line["response_id"])
    assert record is not None and PDF_DATA not in str(record)  # a reference, never the bytes
    assert record[0]["parts"][1] == {"type": "input_file", "file": {
        "sha256": SHA, "media_type": "application/pdf", "bytes": len(PDF), "pages": 2, "name": "report.pdf"}}
    assert await blobs(http) == [SHA]
    # the client resends its history, the PDF with it: the same conversation, the PDF sent again
    asked += [{"role": "assistant", "content": "It moved."}, {"role": "user", "content": "When?"}]
    second = await client.messages.with_raw_response.create(model=PDF_MODEL, max_tokens=20, messages=asked)
    assert second.headers["x-ksi-conversation-id"] == conversation_id
    assert user_turns(stub) == [[{"type": "text", "text": FIRST_TEXT}, FILE_PART], "When?"]
    assert await conversations(http) == {conversation_id: 2}
    # the turn's input was counted with the PDF's two pages
    assert line["tokens_in"] >= 2 * TOKENS_PER_PAGE


async def test_a_pdf_is_shown_by_its_label_and_an_export_imports_again(
        http: HttpDaemon, client: anthropic.AsyncAnthropic, stub: StubOpenAI) -> None:
    stub.enqueue("A report.", "More.")  # the stub's own answer would echo what it was sent
    raw = await client.messages.with_raw_response.create(model=PDF_MODEL, max_tokens=20, messages=[
        {"role": "user", "content": [pdf_block(), {"type": "text", "text": "Summarise."}]}])
    conversation_id = raw.headers["x-ksi-conversation-id"]
    root = EventContext.root()
    shown = await http.daemon.router.request(CONVERSATION_SHOW, {"conversation_id": conversation_id}, root)
    assert PDF_DATA not in orjson.dumps(shown).decode()
    [part] = [p for p in shown["exchanges"][0]["input"][0]["content"] if p["type"] == "input_file"]
    assert part["file"]["sha256"] == SHA and part["file"]["name"] == "report.pdf"
    exported = await http.daemon.router.request(CONVERSATION_EXPORT, {"conversation_id": conversation_id,
                                                                      "format": "json"}, root)
    assert PDF_DATA not in exported["content"]
    imported = await http.daemon.router.request(CONVERSATION_IMPORT, {"data": exported["content"],
                                                                      "new_id": "again"}, root)
    assert imported["exchanges"] == 1
    again = await http.daemon.router.request(CONVERSATION_EXPORT, {"conversation_id": "again", "format": "json"},
                                             root)

    def inputs(content: str) -> list[Any]:
        return [x["input"] for x in orjson.loads(content)["exchanges"]]

    assert inputs(again["content"]) == inputs(exported["content"])
    # the imported conversation continues, its PDF sent from the blob store
    await client.messages.create(model=PDF_MODEL, max_tokens=20, extra_headers={"x-ksi-conversation-id": "again"},
                                 messages=[{"role": "user", "content": "And?"}])
    assert user_turns(stub) == [[{"type": "text", "text": "Summarise."}, FILE_PART], "And?"]
    # what a person reads: the PDF's label, never its bytes
    markdown = await http.daemon.router.request(CONVERSATION_EXPORT, {"conversation_id": "again",
                                                                      "format": "markdown"}, root)
    sent = await http.daemon.router.request(CONVERSATION_SENT, {"conversation_id": "again", "n": 2}, root)
    for shown_text in (markdown["content"], orjson.dumps(sent).decode()):
        assert PDF_DATA not in shown_text and "report.pdf" in shown_text
    assert f"[file sha256:{SHA[:12]}\u2026 report.pdf application/pdf" in markdown["content"]


REFUSED: list[tuple[str, str, dict[str, Any], str, str]] = [
    # (what, model, block, KSI code, the field it names)
    # (KSI's part: a message keeps its text first, then its PDFs and images)
    ("a PDF for a model that cannot read one", TEXT_MODEL, pdf_block(), "unsupported_parameter",
     "messages.0.content.1"),
    ("bad base64", PDF_MODEL, pdf_block(data="not base64!"), "validation_error", "messages.0.content.0.source.data"),
    ("not a PDF", PDF_MODEL, pdf_block(data=base64.b64encode(b"hello").decode()), "validation_error",
     "messages.0.content.0.source.data"),
    ("a wrong media type", PDF_MODEL, pdf_block(media_type="application/msword"), "validation_error",
     "messages.0.content.0.source.media_type"),
    ("a URL source", PDF_MODEL, {"type": "document", "source": {"type": "url", "url": "https://example.org/a.pdf"}},
     "unsupported_parameter", "messages.0.content.0.source.type"),
    ("citations", PDF_MODEL, {**NOTES, "citations": {"enabled": True}}, "unsupported_parameter",
     "messages.0.content.0.citations"),
]


@pytest.mark.parametrize(("what", "model", "block", "code", "field"), REFUSED, ids=[r[0] for r in REFUSED])
async def test_refused_documents_write_nothing(http: HttpDaemon, client: anthropic.AsyncAnthropic, stub: StubOpenAI,
                                               what: str, model: str, block: dict[str, Any], code: str,
                                               field: str) -> None:
    before = await stored_snapshot(http.daemon.settings)
    with pytest.raises(anthropic.BadRequestError) as refused:
        await client.post("/v1/messages", cast_to=httpx.Response, body={"model": model, "max_tokens": 10, "messages": [
            {"role": "user", "content": [block, {"type": "text", "text": "read it"}]}]})
    error: Any = refused.value.body
    assert error["error"]["code"] == code, error
    assert field in error["error"]["details"]["fields"], error
    if what.startswith("a PDF for"):
        assert TEXT_MODEL in error["error"]["message"] and "supports_pdf_input" in error["error"]["message"]
    assert await stored_snapshot(http.daemon.settings) == before
    assert await conversations(http) == {} and await blobs(http) == []
    assert stub.requests == []


READ = {"name": "read", "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}
CALLED: Any = [{"role": "user", "content": "Read report.pdf"}, {"role": "assistant", "content": [
    {"type": "tool_use", "id": "toolu_r", "name": "read", "input": {"path": "report.pdf"}}]}]


@pytest.mark.parametrize(("data", "code", "status"), [
    ("not base64!", "validation_error", 400),
    (base64.b64encode(b"hello").decode(), "validation_error", 400),
    (PDF_DATA, "image_too_large", 413),  # over the limit the daemon is given below
], ids=["bad base64", "not a PDF", "too large"])
@pytest.mark.parametrize("placed", ["after text", "in a tool result"])
async def test_the_daemons_pdf_check_names_the_document_block(
        short_tmp: Path, stub: StubOpenAI, backend: dict[str, Any], data: str, code: str, status: int,
        placed: str) -> None:
    """The daemon checks a PDF's bytes for every door; its error names the block they came in,
    which is not where KSI's message holds the PDF (its text first), nor a field of its own."""
    if placed == "after text":
        messages: Any = [{"role": "user", "content": [{"type": "text", "text": "read them"}, NOTES, pdf_block(data)]}]
        field = "messages.0.content.2.source.data"
    else:
        messages = [*CALLED, {"role": "user", "content": [
            {"type": "text", "text": "here"}, {"type": "tool_result", "tool_use_id": "toolu_r", "content": [
                {"type": "text", "text": "read"}, pdf_block(data)]}]}]
        field = "messages.2.content.1.content.1.source.data"
    models = {PDF_MODEL: {"api_base": stub.api_base, "supports_pdf_input": True}}
    async with running_http_daemon(short_tmp, **stub_settings(stub, models=models), summariser="off",
                                   max_image_bytes=len(PDF) - 1, **backend) as http, sdk(http) as client:
        before = await stored_snapshot(http.daemon.settings)
        with pytest.raises(anthropic.APIStatusError) as refused:
            await client.messages.create(model=PDF_MODEL, max_tokens=10, tools=[READ], messages=messages)
        assert await stored_snapshot(http.daemon.settings) == before
        assert await conversations(http) == {} and await blobs(http) == []
    error: Any = refused.value.body
    assert refused.value.status_code == status and error["error"]["code"] == code, error
    assert list(error["error"]["details"]["fields"]) == [field], error
    assert error["error"]["message"].startswith(field) and "file_data" not in error["error"]["message"]
    assert stub.requests == []


async def test_count_tokens_refuses_a_pdf_that_is_not_base64_naming_its_block(
        http: HttpDaemon, client: anthropic.AsyncAnthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as refused:
        await client.messages.count_tokens(model=PDF_MODEL, messages=[
            {"role": "user", "content": [{"type": "text", "text": "read it"}, pdf_block(data="not base64!")]}])
    error: Any = refused.value.body
    assert error["error"]["code"] == "validation_error"
    assert list(error["error"]["details"]["fields"]) == ["messages.0.content.1.source.data"]


async def test_a_text_document_reaches_a_model_that_reads_no_pdf(
        client: anthropic.AsyncAnthropic, stub: StubOpenAI) -> None:
    await client.messages.create(model=TEXT_MODEL, max_tokens=20, messages=[{"role": "user", "content": [NOTES]}])
    assert user_turns(stub) == ["[document Notes]\nThe launch moved to May."]


async def test_a_pdf_a_tool_read_reaches_the_model_in_the_users_message(
        client: anthropic.AsyncAnthropic, stub: StubOpenAI) -> None:
    """Claude Code's Read tool returns a PDF it read as a document block inside the tool_result."""
    read = {"name": "read", "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}
    stub.enqueue(Reply(calls=[{"id": "toolu_r", "name": "read", "arguments": {"path": "report.pdf"}}]), "Two pages.")
    ask: Any = {"role": "user", "content": "Read report.pdf"}
    first = await client.messages.create(model=PDF_MODEL, max_tokens=100, tools=[read], messages=[ask])
    await client.messages.create(model=PDF_MODEL, max_tokens=100, tools=[read], messages=[
        ask, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_r", "content": [pdf_block()]}]}])
    tool, user = stub.requests[-1]["messages"][-2:]
    assert tool["content"] == "[1 attachment of this result: in the user's message]"
    assert user["content"] == [{"type": "text", "text": "[attachments of the result of toolu_r]"}, FILE_PART]


async def test_count_tokens_counts_a_pdf_by_its_pages(http: HttpDaemon, client: anthropic.AsyncAnthropic) -> None:
    before = await stored_snapshot(http.daemon.settings)
    text = await client.messages.count_tokens(model=PDF_MODEL, messages=[{"role": "user", "content": "read it"}])
    counted = await client.messages.count_tokens(model=PDF_MODEL, messages=[
        {"role": "user", "content": [pdf_block(), {"type": "text", "text": "read it"}]}])
    assert counted.input_tokens >= text.input_tokens + 2 * TOKENS_PER_PAGE
    assert await stored_snapshot(http.daemon.settings) == before
