"""Compaction on the Responses door, KSI's way: POST /v1/responses/compact through the openai SDK,
the compaction_trigger contract (exactly one compaction item, no model called, nothing stored),
context_management's compact_threshold, and a compaction item replayed as input restoring exactly
the stored context, after which the conversation is continued, forked and exported through the
socket's events. Its content is readable: the conversation, the response, KSI's checked summaries
and pins. Both storage backends."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI, BadRequestError, NotFoundError
from openai.types.responses import CompactedResponse

from tests.conftest import HttpDaemon, complete, connected, running_http_daemon, stub_settings
from tests.responses_conformance import conforming_compacted, conforming_event, conforming_response
from tests.stored import stored_index
from tests.stub_openai import StubOpenAI
from tests.test_compaction import SMALL, answering, good, grow, settings, settled

pytestmark = pytest.mark.parametrize("backend", ["jsonl", "postgres"], indirect=True)
MODEL = "openai/stub-model"


@pytest.fixture
async def http(short_tmp: Path, stub: StubOpenAI, backend: dict[str, Any]) -> AsyncIterator[HttpDaemon]:
    async with running_http_daemon(short_tmp, **stub_settings(stub), **backend) as running:
        yield running


def sdk(http: HttpDaemon) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=http.base_url + "/v1", api_key=http.token, max_retries=0)


def content(item: dict[str, Any]) -> dict[str, Any]:
    assert item["type"] == "compaction" and item["created_by"] == "ksi"
    return json.loads(item["encrypted_content"])


async def post(http: HttpDaemon, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=http.base_url, timeout=60,
                                 headers={"Authorization": f"Bearer {http.token}"}) as client:
        return await client.post("/v1/responses", json=body)


async def test_compact_then_replay_continues_the_same_conversation(http: HttpDaemon, stub: StubOpenAI) -> None:
    client = sdk(http)
    first = await client.responses.create(model=MODEL, input="my locker is 4817")
    second = await client.responses.create(model=MODEL, input="and my train is at 9", previous_response_id=first.id)
    compacted = await client.responses.compact(model=MODEL, previous_response_id=second.id)
    assert isinstance(compacted, CompactedResponse) and compacted.object == "response.compaction"
    conforming_compacted(compacted.to_dict())
    (item,) = [entry.to_dict() for entry in compacted.output]
    held = content(item)
    conversation = held["conversation_id"]
    assert (held["response_id"], held["exchanges"], held["carried"]) == (second.id, 2, [])
    before = len(stub.requests)
    assert len(await stored_index(http.daemon, conversation)) == 2  # compacting wrote nothing
    assert len(stub.requests) == before  # nor called a model
    # the client replaces its history with the item: KSI restores exactly that context
    third = await client.responses.create(model=MODEL, input=[item, {"role": "user", "content": "what is my locker?"}])
    conforming_response(third.to_dict())
    assert third.conversation is not None and third.conversation.id == conversation
    assert [m["content"] for m in stub.messages()] == [
        "my locker is 4817", stub.messages()[1]["content"], "and my train is at 9", stub.messages()[3]["content"],
        "what is my locker?"]
    # the conversation goes on from every other door: the socket's events continue, fork and export it
    async with connected(http.daemon) as socket_client:
        fourth = await complete(socket_client, conversation_id=conversation, prompt="and from the socket")
        assert fourth["conversation_id"] == conversation
        fork = await socket_client.request("conversation:fork", {"conversation_id": conversation, "at": 2})
        exported = await socket_client.request("conversation:export", {"conversation_id": conversation,
                                                                      "format": "json"})
    assert exported["exchanges"] == 4 and "what is my locker?" in exported["content"]
    assert fork["conversation_id"] != conversation
    assert len(await stored_index(http.daemon, conversation)) == 4


async def test_compact_carries_the_items_kept_after_the_stored_response(http: HttpDaemon, stub: StubOpenAI) -> None:
    client = sdk(http)
    first = await client.responses.create(model=MODEL, input="start")
    history = [{"role": "user", "content": "start"}, first.output[0].to_dict(), {"role": "user", "content": "later"}]
    compacted = await client.responses.compact(model=MODEL, input=history)  # type: ignore[arg-type]
    held = content(compacted.output[0].to_dict())
    assert held["response_id"] == first.id and held["carried"] == [{"role": "user", "content": "later"}]
    replayed = await client.responses.create(model=MODEL, input=[compacted.output[0].to_dict(),
                                                                 {"role": "user", "content": "now"}])
    assert stub.messages() == [{"role": "user", "content": "start"}, {"role": "assistant", "content": first.output_text},
                               {"role": "user", "content": "later"}, {"role": "user", "content": "now"}]
    assert replayed.conversation is not None and replayed.conversation.id == held["conversation_id"]
    # a compacted history compacted again: the same stored point, the items added since carried
    again = await client.responses.compact(model=MODEL, input=[  # type: ignore[arg-type]
        compacted.output[0].to_dict(), {"role": "user", "content": "more"}])
    held_again = content(again.output[0].to_dict())
    assert held_again["response_id"] == first.id
    assert held_again["carried"] == [{"role": "user", "content": "later"}, {"role": "user", "content": "more"}]


async def test_the_item_shows_the_pinned_exchanges(http: HttpDaemon) -> None:
    client = sdk(http)
    first = await client.responses.create(model=MODEL, input="pin this one")
    second = await client.responses.create(model=MODEL, input="not this", previous_response_id=first.id)
    async with connected(http.daemon) as socket_client:
        await socket_client.request("conversation:pin", {"conversation_id": first.conversation.id,  # type: ignore[union-attr]
                                                         "n": 1})
    held = content((await client.responses.compact(model=MODEL, previous_response_id=second.id)).output[0].to_dict())
    assert held["pinned"] == [1] and held["exchanges"] == 2


async def test_a_trigger_is_answered_by_one_compaction_item_and_never_stored(
        http: HttpDaemon, stub: StubOpenAI) -> None:
    client = sdk(http)
    first = await client.responses.create(model=MODEL, input="remember 12")
    conversation = first.conversation.id  # type: ignore[union-attr]
    calls = len(stub.requests)
    for stream in (False, True):
        body = {"model": MODEL, "stream": stream, "store": False, "previous_response_id": first.id,
                "input": [{"role": "user", "content": "one more"}, {"type": "compaction_trigger"}]}
        reply = await post(http, body)
        assert reply.status_code == 200, reply.text
        if stream:
            events = [json.loads(line[5:]) for line in reply.text.splitlines() if line.startswith("data:")]
            for event in events:
                conforming_event(event)
            response = events[-1]["response"]
        else:
            response = reply.json()
        conforming_response(response)
        (item,) = response["output"]
        held = content(item)
        assert held["response_id"] == first.id and held["carried"] == [{"role": "user", "content": "one more"}]
    assert len(stub.requests) == calls
    assert len(await stored_index(http.daemon, conversation)) == 1


async def test_compact_threshold_adds_a_compaction_item(http: HttpDaemon) -> None:
    rule = [{"type": "compaction", "compact_threshold": 1}]
    plain = await post(http, {"model": MODEL, "input": "hello", "context_management": rule})
    response = conforming_response(plain.json()).to_dict()
    assert [item["type"] for item in response["output"]] == ["message", "compaction"]
    assert content(response["output"][1])["response_id"] == response["id"]
    streamed = await post(http, {"model": MODEL, "input": "hello", "stream": True, "context_management": rule})
    events = [json.loads(line[5:]) for line in streamed.text.splitlines() if line.startswith("data:")]
    for event in events:
        conforming_event(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [item["type"] for item in events[-1]["response"]["output"]] == ["message", "compaction"]
    high = await post(http, {"model": MODEL, "input": "hello", "context_management": [
        {"type": "compaction", "compact_threshold": 10**6}]})
    assert [item["type"] for item in high.json()["output"]] == ["message"]
    # a conversation is compacted when its input crosses the threshold, not again at every turn above it
    below = {"type": "compaction", "compact_threshold": 40}
    turn = (await post(http, {"model": MODEL, "input": "short", "context_management": [below]})).json()
    kinds = []
    for n in range(4):
        turn = (await post(http, {"model": MODEL, "previous_response_id": turn["id"], "context_management": [below],
                                  "input": f"turn {n}: a longer message that makes the history grow past forty"})).json()
        kinds.append([item["type"] for item in turn["output"]])
    assert kinds.count(["message", "compaction"]) == 1 and kinds[0] == ["message"]


async def test_bad_compaction_input_is_refused_and_nothing_is_written(http: HttpDaemon, stub: StubOpenAI) -> None:
    client = sdk(http)
    foreign = {"type": "compaction", "id": "cmp_x", "encrypted_content": "gAAAAB-opaque"}
    with pytest.raises(BadRequestError) as refused:
        await client.responses.create(model=MODEL, input=[foreign, {"role": "user", "content": "hi"}])  # type: ignore[list-item]
    assert refused.value.code == "validation_error"
    assert refused.value.body["param"] == "input.0.encrypted_content"  # type: ignore[index]
    with pytest.raises(NotFoundError) as missing:
        await client.responses.compact(model=MODEL, previous_response_id="resp_openai-stub-model-000000000000")
    assert missing.value.code == "previous_response_not_found"
    for rule, code in (([{"type": "truncate"}], "unsupported_parameter"),
                       ([{"type": "compaction", "compact_threshold": 0}], "validation_error")):
        reply = await post(http, {"model": MODEL, "input": "x", "context_management": rule})
        assert reply.status_code == 400 and reply.json()["error"]["code"] == code
    assert stub.requests == []
    async with connected(http.daemon) as socket_client:
        listed = await socket_client.request("conversation:list", {})
    assert listed["total"] == 0


async def test_the_item_shows_the_stored_summaries(short_tmp: Path, stub: StubOpenAI, backend: dict[str, Any]) -> None:
    stub.answer = answering(good)
    async with running_http_daemon(short_tmp, **settings(stub), **backend) as http:
        results = await grow(http.daemon, "long", range(1, 13))
        await settled(http.daemon)
        compacted = await sdk(http).responses.compact(model=SMALL, previous_response_id=results[-1]["response_id"])
        held = content(compacted.output[0].to_dict())
    assert held["conversation_id"] == "long" and held["exchanges"] == 12
    assert held["summaries"] and all(s["upto"] <= 12 for s in held["summaries"])
    assert "Alice Bowman" in " ".join(s["text"] for s in held["summaries"])
