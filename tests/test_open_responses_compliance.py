"""The Open Responses compliance scenarios (basic, streaming, system prompt, tool calling, tool
calling streamed, image input, multi-turn, assistant phase, the compaction endpoint, and the
WebSocket ones: a response, sequential responses on one socket, a store: false continuation on
the connection, a reconnect answered previous_response_not_found then recovering, a missing
previous response, a failed continuation evicting the connection's cache), sent as the specification's published test templates
send them (plain JSON bodies to POST /v1/responses, `stream` set for the streamed ones), against a
real daemon, real litellm and the stub. Every response object and every streaming event is
validated against the specification's types (`openresponses-types`) and the openai SDK's, then
checked as the templates check them, and the stub is checked to have been asked what the client
asked."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import HttpDaemon, running_http_daemon, stub_settings
from tests.image_bytes import png
from tests.responses_conformance import conforming_compacted, conforming_event, conforming_response
from tests.stored import stored_index
from tests.stub_openai import Reply, StubOpenAI
from tests.test_http_responses_websocket import final, socket, turn, user
from tests.test_image_files import data_url, vision_models

MODEL = "openai/stub-vision"
# the template sends a 32x32 PNG as a data URL: one of the same size, made here
PICTURE = data_url(png(32, 32, shade=200), "image/png")
WEATHER_TOOL = {
    "type": "function", "name": "get_weather", "description": "Get the current weather for a location",
    "parameters": {"type": "object", "properties": {
        "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"}},
        "required": ["location"]},
}
WEATHER_CALL = Reply(calls=[{"id": "call_sf", "name": "get_weather", "arguments": {"location": "San Francisco, CA"}}])


def message(role: str, content: Any) -> dict[str, Any]:
    return {"type": "message", "role": role, "content": content}


@pytest.fixture
async def http(short_tmp: Path, stub: StubOpenAI) -> AsyncIterator[HttpDaemon]:
    async with running_http_daemon(short_tmp, **stub_settings(stub, **vision_models(stub))) as running:
        yield running


async def create(http: HttpDaemon, body: dict[str, Any], stream: bool = False) -> dict[str, Any]:
    """POST the body as the templates do; the response object (a stream's final one) after every
    object and event was validated, with the stream's events under `_events`."""
    async with httpx.AsyncClient(base_url=http.base_url, headers={"Authorization": f"Bearer {http.token}"},
                                 timeout=60) as client:
        if not stream:
            reply = await client.post("/v1/responses", json={**body, "stream": False})
            assert reply.status_code == 200, reply.text
            data: dict[str, Any] = reply.json()
            conforming_response(data)
            return data
        events: list[dict[str, Any]] = []
        async with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as reply:
            assert reply.status_code == 200
            assert reply.headers["content-type"].startswith("text/event-stream")
            async for line in reply.aiter_lines():
                if line.startswith("data:") and line[5:].strip() != "[DONE]":
                    events.append(json.loads(line[5:]))
    for event in events:
        conforming_event(event)
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    finals = [e for e in events if e["type"] in ("response.completed", "response.failed", "response.incomplete")]
    assert len(finals) == 1 and events[-1] is finals[0]
    return {**finals[0]["response"], "_events": events}


def output_types(response: dict[str, Any]) -> list[str]:
    return [item["type"] for item in response["output"]]


async def test_basic_response(http: HttpDaemon, stub: StubOpenAI) -> None:
    stub.enqueue("Hello there, friend.")
    response = await create(http, {"model": MODEL, "input": [message("user", "Say hello in exactly 3 words.")]})
    assert response["status"] == "completed" and output_types(response) == ["message"]
    assert response["output"][0]["content"][0]["text"] == "Hello there, friend."
    assert stub.messages()[-1] == {"role": "user", "content": "Say hello in exactly 3 words."}


async def test_streaming_response(http: HttpDaemon, stub: StubOpenAI) -> None:
    stub.enqueue("1, 2, 3, 4, 5")
    response = await create(http, {"model": MODEL, "input": [message("user", "Count from 1 to 5.")]}, stream=True)
    assert response["status"] == "completed"
    kinds = [event["type"] for event in response["_events"]]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    deltas = "".join(e["delta"] for e in response["_events"] if e["type"] == "response.output_text.delta")
    assert deltas == "1, 2, 3, 4, 5" == response["output"][0]["content"][0]["text"]


async def test_system_prompt(http: HttpDaemon, stub: StubOpenAI) -> None:
    stub.enqueue("Ahoy, matey!")
    response = await create(http, {"model": MODEL, "input": [
        message("system", "You are a pirate. Always respond in pirate speak."), message("user", "Say hello.")]})
    assert response["status"] == "completed" and output_types(response) == ["message"]
    assert stub.messages()[0] == {"role": "system", "content": "You are a pirate. Always respond in pirate speak."}
    assert stub.messages()[-1] == {"role": "user", "content": "Say hello."}


async def test_tool_calling(http: HttpDaemon, stub: StubOpenAI) -> None:
    stub.enqueue(WEATHER_CALL)
    response = await create(http, {"model": MODEL, "tools": [WEATHER_TOOL], "input": [
        message("user", "What's the weather like in San Francisco?")]})
    assert output_types(response) == ["function_call"]
    call = response["output"][0]
    assert (call["call_id"], call["name"], json.loads(call["arguments"])) == (
        "call_sf", "get_weather", {"location": "San Francisco, CA"})
    assert [tool["function"]["name"] for tool in stub.requests[-1]["tools"]] == ["get_weather"]
    assert response["tools"][0]["name"] == "get_weather"


async def test_tool_calling_streamed(http: HttpDaemon, stub: StubOpenAI) -> None:
    stub.enqueue(WEATHER_CALL)
    response = await create(http, {"model": MODEL, "tools": [WEATHER_TOOL], "input": [
        message("user", "What's the weather like in San Francisco?")]}, stream=True)
    events = response["_events"]
    kinds = [event["type"] for event in events]
    assert any(e["type"] == "response.output_item.added" and e["item"]["type"] == "function_call" for e in events)
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert any(e["type"] == "response.output_item.done" and e["item"]["type"] == "function_call" for e in events)
    arguments = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert json.loads(arguments) == {"location": "San Francisco, CA"}
    assert output_types(response) == ["function_call"] and response["status"] == "completed"


async def test_image_input(http: HttpDaemon, stub: StubOpenAI) -> None:
    stub.enqueue("A grey square.")
    response = await create(http, {"model": MODEL, "input": [message("user", [
        {"type": "input_text", "text": "What do you see in this image? Answer in one sentence."},
        {"type": "input_image", "image_url": PICTURE}])]})
    assert response["status"] == "completed" and output_types(response) == ["message"]
    sent = stub.messages()[-1]["content"]
    assert sent == [{"type": "text", "text": "What do you see in this image? Answer in one sentence."},
                    {"type": "image_url", "image_url": {"url": PICTURE}}]


async def test_multi_turn(http: HttpDaemon, stub: StubOpenAI) -> None:
    stub.enqueue("Your name is Alice.")
    response = await create(http, {"model": MODEL, "input": [
        message("user", "My name is Alice."),
        message("assistant", "Hello Alice! Nice to meet you. How can I help you today?"),
        message("user", "What is my name?")]})
    assert response["status"] == "completed" and output_types(response) == ["message"]
    assert [(m["role"], m["content"]) for m in stub.messages()] == [
        ("user", "My name is Alice."), ("assistant", "Hello Alice! Nice to meet you. How can I help you today?"),
        ("user", "What is my name?")]
    # the client's history was kept as the conversation's first exchange, the answer as its second
    conversation = response["conversation"]["id"]
    assert len(await stored_index(http.daemon, conversation)) == 2


async def test_assistant_phase_on_input_and_output(http: HttpDaemon, stub: StubOpenAI) -> None:
    stub.enqueue("Your name is Alice.")
    assistant = {**message("assistant", [{"type": "output_text", "text": "Checking my notes."}]),
                 "phase": "commentary"}
    response = await create(http, {"model": MODEL, "input": [
        message("user", "My name is Alice."), assistant, message("user", "What is my name?")]})
    assert output_types(response) == ["message"] and response["output"][0].get("phase") in (None, "final_answer")
    assert [(m["role"], m["content"]) for m in stub.messages()] == [
        ("user", "My name is Alice."), ("assistant", "Checking my notes."), ("user", "What is my name?")]
    async with httpx.AsyncClient(base_url=http.base_url, headers={"Authorization": f"Bearer {http.token}"}) as client:
        reply = await client.post("/v1/responses", json={"model": MODEL, "input": [
            message("user", "hi"), {**assistant, "phase": "thinking"}, message("user", "again")]})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "input.1.phase"


async def test_compaction_endpoint(http: HttpDaemon, stub: StubOpenAI) -> None:
    first = await create(http, {"model": MODEL, "input": [message("user", "Remember the number 31.")]})
    async with httpx.AsyncClient(base_url=http.base_url, headers={"Authorization": f"Bearer {http.token}"}) as client:
        reply = await client.post("/v1/responses/compact", json={
            "model": MODEL, "prompt_cache_key": "compaction-scenario", "input": [
                message("user", "Remember the number 31."), first["output"][0], message("user", "And 32.")]})
    assert reply.status_code == 200, reply.text
    compacted = conforming_compacted(reply.json())
    assert compacted["object"] == "response.compaction"
    assert [item["type"] for item in compacted["output"]] == ["compaction"]
    stub.enqueue("31 and 32.")
    answer = await create(http, {"model": MODEL, "input": [compacted["output"][0], message("user", "Which numbers?")]})
    assert answer["conversation"]["id"] == first["conversation"]["id"]
    assert [m["content"] for m in stub.messages()][-2:] == ["And 32.", "Which numbers?"]


async def test_websocket_response(http: HttpDaemon, stub: StubOpenAI) -> None:
    stub.enqueue("Hello there, friend.")
    async with socket(http) as ws:
        frames = await turn(ws, model=MODEL, input=[user("Say hello in exactly 3 words.")])
    assert [f["type"] for f in frames][:2] == ["response.created", "response.in_progress"]
    assert final(frames)["output"][0]["content"][0]["text"] == "Hello there, friend."


async def test_websocket_sequential_responses(http: HttpDaemon, stub: StubOpenAI) -> None:
    async with socket(http) as ws:
        ids = [final(await turn(ws, model=MODEL, input=[user(f"turn {n}")]))["id"] for n in range(3)]
    assert len(set(ids)) == 3 and len(stub.requests) == 3


async def test_websocket_store_false_continuation(http: HttpDaemon, stub: StubOpenAI) -> None:
    async with socket(http) as ws:
        first = final(await turn(ws, model=MODEL, store=False, input=[user("My name is Alice.")]))
        second = final(await turn(ws, model=MODEL, store=False, previous_response_id=first["id"],
                                  input=[user("What is my name?")]))
    assert second["previous_response_id"] == first["id"]
    assert [m["content"] for m in stub.messages()][::2] == ["My name is Alice.", "What is my name?"]


async def test_websocket_reconnect_then_recover(http: HttpDaemon, stub: StubOpenAI) -> None:
    async with socket(http) as ws:
        first = final(await turn(ws, model=MODEL, store=False, input=[user("My name is Alice.")]))
    async with socket(http) as ws:
        refused = await turn(ws, model=MODEL, store=False, previous_response_id=first["id"],
                             input=[user("What is my name?")])
        assert refused[-1]["error"]["code"] == "previous_response_not_found"
        again = final(await turn(ws, model=MODEL, store=False, input=[
            user("My name is Alice."), message("assistant", [{"type": "output_text", "text":
                                                               first["output"][0]["content"][0]["text"]}]),
            user("What is my name?")]))
    assert again["conversation"]["id"] == first["conversation"]["id"]


async def test_websocket_missing_previous_response(http: HttpDaemon) -> None:
    async with socket(http) as ws:
        refused = await turn(ws, model=MODEL, previous_response_id="resp_does-not-exist", input=[user("hi")])
    assert refused[-1]["status"] == 404 and refused[-1]["error"]["code"] == "previous_response_not_found"


async def test_websocket_failed_continuation_evicts_the_cache(http: HttpDaemon, stub: StubOpenAI) -> None:
    async with socket(http) as ws:
        first = final(await turn(ws, model=MODEL, store=False, input=[user("start")]))
        bad = await turn(ws, model=MODEL, store=False, previous_response_id=first["id"],
                         input=[user("x")], temperature=9)
        assert bad[-1]["type"] == "error" and bad[-1]["error"]["code"] == "validation_error"
        refused = await turn(ws, model=MODEL, store=False, previous_response_id=first["id"], input=[user("y")])
    assert refused[-1]["error"]["code"] == "previous_response_not_found"
