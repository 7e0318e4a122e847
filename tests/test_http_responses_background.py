"""Background responses and resumable streams on /v1/responses with the official `openai` SDK,
against a real in-process daemon, real litellm and the stub; every Response object and stream
event is checked against the SDK's types and the Open Responses required fields."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import openai
import pytest

from ksi_common.errors import ErrorCode
from ksi_common.jsonl import read_records
from ksi_daemon.context import EventContext
from tests.conftest import HttpDaemon
from tests.responses_conformance import conforming_events, conforming_response
from tests.stub_openai import Reply, StubOpenAI

ANSWER = "alpha beta gamma delta"
T = TypeVar("T")


@pytest.fixture
async def client(http_daemon: HttpDaemon) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{http_daemon.base_url}/v1", api_key=http_daemon.token,
                                  max_retries=0) as api:
        yield api


def ksi_id(response_id: str) -> str:
    assert response_id.startswith("resp_")
    return response_id.removeprefix("resp_")


async def until(probe: Callable[[], Awaitable[T]], done: Callable[[T], bool]) -> T:
    """Poll `probe` until `done` holds for its value (a safety net of a minute, not a timing check)."""
    async with asyncio.timeout(60):
        while True:
            value = await probe()
            if done(value):
                return value
            await asyncio.sleep(0.02)


async def fetched(client: openai.AsyncOpenAI, response_id: str) -> dict[str, Any]:
    """GET /v1/responses/{id} as sent, checked."""
    raw = await client.responses.with_raw_response.retrieve(response_id)
    data = raw.http_response.json()
    conforming_response(data)
    return data


def text_of(data: dict[str, Any]) -> str:
    return "".join(part["text"] for item in data["output"] for part in item["content"])


def indexed(http: HttpDaemon, conversation_id: str) -> list[str]:
    path = http.daemon.layout.index_file(conversation_id)
    return [line["response_id"] for line in read_records(path)] if path.exists() else []


async def test_a_background_response_is_polled_until_it_completes(
        http_daemon: HttpDaemon, client: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    gate = asyncio.Event()
    stub.enqueue(Reply(text=ANSWER, gate=gate))  # the first word, then held until the gate opens
    raw = await client.responses.with_raw_response.create(model="openai/stub-model", input="go", background=True,
                                                         temperature=0.5, metadata={"job": "7"})
    created = conforming_response(raw.http_response.json())
    assert created.status == "queued" and created.background and created.output == []
    running = await until(lambda: fetched(client, created.id), lambda r: text_of(r) == "alpha ")
    assert running["status"] == "in_progress" and running["completed_at"] is None
    gate.set()
    done = await until(lambda: fetched(client, created.id), lambda r: r["status"] == "completed")
    assert text_of(done) == ANSWER and done["background"] is True
    assert (done["temperature"], done["metadata"]) == (0.5, {"job": "7"})
    assert done["usage"]["output_tokens"] > 0 and done["completed_at"] >= done["created_at"]
    assert indexed(http_daemon, done["conversation"]["id"]) == [ksi_id(created.id)]
    # the SDK's own object for the same response, and the chain continues by its id
    nxt = await client.responses.create(input="and?", previous_response_id=created.id)
    assert nxt.conversation is not None and nxt.conversation.id == done["conversation"]["id"]
    assert stub.messages()[:2] == [{"role": "user", "content": "go"}, {"role": "assistant", "content": ANSWER}]


async def test_a_dropped_stream_resumes_with_exactly_the_missing_events(
        http_daemon: HttpDaemon, client: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    gate = asyncio.Event()
    stub.enqueue(Reply(text=ANSWER, gate=gate))
    stream = await client.responses.create(model="openai/stub-model", input="go", background=True, stream=True)
    before = []
    async for event in stream:
        before.append(event)
        if event.type == "response.output_text.delta":
            break
    await stream.close()  # the client's connection drops after the first delta
    gate.set()  # the response runs on in the daemon
    response_id = before[0].response.id  # type: ignore[union-attr]
    last = before[-1].sequence_number
    resumed = await client.responses.retrieve(response_id, stream=True, starting_after=last)
    after = [event async for event in resumed]
    events = conforming_events(before + after)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))  # none missing, none twice
    assert after[0].sequence_number == last + 1
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == ANSWER
    assert [e["type"] for e in events[:4]] == ["response.created", "response.in_progress",
                                               "response.output_item.added", "response.content_part.added"]
    assert [e["type"] for e in events[-4:]] == ["response.output_text.done", "response.content_part.done",
                                                "response.output_item.done", "response.completed"]
    final = events[-1]["response"]
    assert text_of(final) == ANSWER and final["status"] == "completed"
    assert indexed(http_daemon, final["conversation"]["id"]) == [ksi_id(response_id)]  # not cancelled
    # read again from its start, the stream numbers every event as before
    again = [event async for event in await client.responses.retrieve(response_id, stream=True)]
    replayed = conforming_events(again)
    assert [(e["type"], e["sequence_number"], e.get("delta")) for e in replayed] == [
        (e["type"], e["sequence_number"], e.get("delta")) for e in events]


async def test_starting_after_beyond_the_stream_and_a_stream_not_kept_are_refused(
        http_daemon: HttpDaemon, client: openai.AsyncOpenAI) -> None:
    stream = await client.responses.create(model="openai/stub-model", input="go", background=True, stream=True)
    events = conforming_events([event async for event in stream])
    last = events[-1]["sequence_number"]
    response_id = events[-1]["response"]["id"]
    with pytest.raises(openai.BadRequestError) as beyond:
        await client.responses.retrieve(response_id, stream=True, starting_after=last + 1)
    assert beyond.value.code == ErrorCode.STARTING_AFTER_OUT_OF_RANGE
    assert isinstance(beyond.value.body, dict) and beyond.value.body["param"] == "starting_after"
    with pytest.raises(openai.BadRequestError) as negative:
        await client.responses.retrieve(response_id, stream=True, starting_after=-2)
    assert negative.value.code == ErrorCode.VALIDATION_ERROR
    # the last event itself: nothing is missing
    assert [event async for event in await client.responses.retrieve(
        response_id, stream=True, starting_after=last)] == []
    # a foreground response's events are not kept: there is no stream to resume
    foreground = await client.responses.create(model="openai/stub-model", input="now")
    with pytest.raises(openai.NotFoundError) as gone:
        await client.responses.retrieve(foreground.id, stream=True, starting_after=0)
    assert gone.value.code == ErrorCode.STREAM_NOT_FOUND
    # nothing was written for either refusal: each response is one exchange of its own conversation
    assert indexed(http_daemon, events[-1]["response"]["conversation"]["id"]) == [ksi_id(response_id)]
    assert foreground.conversation is not None
    assert indexed(http_daemon, foreground.conversation.id) == [ksi_id(foreground.id)]


async def test_cancel_a_running_background_response_and_a_finished_one(
        http_daemon: HttpDaemon, client: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    gate = asyncio.Event()
    stub.enqueue(Reply(text=ANSWER, gate=gate))
    created = await client.responses.create(model="openai/stub-model", input="go", background=True)
    # cancelled in the first moments of its run (while the model's window is looked up), the gate
    # holding its answer: the cancel must not be lost there
    await until(lambda: fetched(client, created.id), lambda r: r["status"] == "in_progress")
    raw = await client.responses.with_raw_response.cancel(ksi_id(created.id))  # either form of the id
    cancelled = conforming_response(raw.http_response.json())
    assert cancelled.id == created.id and cancelled.status == "cancelled" and cancelled.error is None
    assert (await fetched(client, created.id))["status"] == "cancelled"
    listing = await http_daemon.daemon.router.request("conversation:list", {}, EventContext.root())
    assert listing["conversations"] == []  # nothing indexed: the conversation made for it is gone
    record = read_records(http_daemon.daemon.layout.response_file(ksi_id(created.id)))
    assert record[-1]["type"] == "error" and record[-1]["code"] == ErrorCode.CANCELLED
    with pytest.raises(openai.ConflictError) as again:
        await client.responses.cancel(created.id)
    assert again.value.code == ErrorCode.RESPONSE_NOT_CANCELLABLE
    finished = await client.responses.create(model="openai/stub-model", input="quick")
    with pytest.raises(openai.ConflictError) as ended:
        await client.responses.cancel(finished.id)
    assert ended.value.code == ErrorCode.RESPONSE_NOT_CANCELLABLE
    assert finished.conversation is not None
    assert indexed(http_daemon, finished.conversation.id) == [ksi_id(finished.id)]  # left as it was
    with pytest.raises(openai.NotFoundError) as unknown:
        await client.responses.cancel("resp_openai-stub-model-000000000000")
    assert unknown.value.code == ErrorCode.RESPONSE_NOT_FOUND
    gate.set()


async def test_foreground_objects_and_events_conform_and_ids_take_either_form(
        http_daemon: HttpDaemon, client: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    raw = await client.responses.with_raw_response.create(
        model="openai/stub-model", input="first", instructions="Be brief.", top_p=0.5,
        text={"format": {"type": "json_schema", "name": "answer", "schema": {"type": "object"}}},
        extra_body={"presence_penalty": 0.25})
    first = conforming_response(raw.http_response.json())
    assert (first.top_p, first.presence_penalty, first.frequency_penalty) == (0.5, 0.25, 0.0)
    assert first.text is not None and first.text.format.type == "json_schema"
    assert first.instructions == "Be brief." and first.background is False
    stream = await client.responses.create(model="openai/stub-model", input="second", stream=True,
                                           previous_response_id=ksi_id(first.id))
    events = conforming_events([event async for event in stream])
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = conforming_response(events[-1]["response"])
    assert final.previous_response_id == first.id  # shown in the door's form, whichever form was sent
    for form in (final.id, ksi_id(final.id)):
        shown = conforming_response((await client.responses.with_raw_response.retrieve(form)).http_response.json())
        assert (shown.id, shown.output_text, shown.previous_response_id) == (final.id, final.output_text, first.id)
        items = await client.responses.input_items.list(form)
        assert [item.content[0].text for item in items.data] == ["second"]  # type: ignore[union-attr]
    assert stub.messages() == [{"role": "user", "content": "first"},
                               {"role": "assistant", "content": "stub answer to: first"},
                               {"role": "user", "content": "second"}]


async def test_an_answer_cut_by_its_token_limit_is_incomplete(
        http_daemon: HttpDaemon, client: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    stub.enqueue(Reply(body='{"id": "c", "object": "chat.completion", "created": 1, "model": "stub-model", '
                            '"choices": [{"index": 0, "message": {"role": "assistant", "content": "cut sho"}, '
                            '"finish_reason": "length"}], "usage": {"prompt_tokens": 3, "completion_tokens": 2, '
                            '"total_tokens": 5}}'))
    raw = await client.responses.with_raw_response.create(model="openai/stub-model", input="go", max_output_tokens=2)
    cut = conforming_response(raw.http_response.json())
    assert cut.status == "incomplete" and cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens" and cut.output_text == "cut sho"
    assert cut.max_output_tokens == 2


async def test_cancel_while_the_provider_is_answering(
        http_daemon: HttpDaemon, client: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    gate = asyncio.Event()
    stub.enqueue(Reply(text=ANSWER, gate=gate))
    created = await client.responses.create(model="openai/stub-model", input="go", background=True)
    await until(lambda: fetched(client, created.id), lambda r: text_of(r) == "alpha ")  # its first word is in
    cancelled = conforming_response((await client.responses.with_raw_response.cancel(created.id)).http_response.json())
    assert cancelled.status == "cancelled" and cancelled.output_text == ""
    listing = await http_daemon.daemon.router.request("conversation:list", {}, EventContext.root())
    assert listing["conversations"] == []
    gate.set()
