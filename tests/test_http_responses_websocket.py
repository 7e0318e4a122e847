"""WebSocket mode of /v1/responses, driven by a real WebSocket client (the `websockets` library)
against a real daemon, real litellm and the stub: sequential responses on one socket, chaining by
previous_response_id with only new items, `generate: false` warm-ups, `store: false` responses held
for the connection only, a failed continuation evicting what the socket held, the bearer token,
the connection budget and cancelling on close. Every event is checked against the specification's
types and the openai SDK's."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from ksi_common.console_login import make_code
from tests.conftest import HttpDaemon, running_http_daemon, stub_settings
from tests.responses_conformance import conforming_event, conforming_ws_error, conforming_ws_request
from tests.stored import stored_index
from tests.stub_openai import Reply, StubOpenAI

pytestmark = pytest.mark.parametrize("backend", ["jsonl", "postgres"], indirect=True)

BETA = {"OpenAI-Beta": "responses_websockets=2026-02-06"}
TOOL = {"type": "function", "name": "shell", "description": "run a command",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}


@pytest.fixture
async def http(short_tmp: Path, stub: StubOpenAI, backend: dict[str, Any]) -> AsyncIterator[HttpDaemon]:
    async with running_http_daemon(short_tmp, **stub_settings(stub), **backend) as running:
        yield running


def ws_url(http: HttpDaemon) -> str:
    return http.base_url.replace("http://", "ws://") + "/v1/responses"


def socket(http: HttpDaemon, token: str | None = None) -> Any:
    headers = {"Authorization": f"Bearer {token or http.token}", **BETA}
    return connect(ws_url(http), additional_headers=headers, open_timeout=10)


def user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


async def turn(ws: ClientConnection, **fields: Any) -> list[dict[str, Any]]:
    """One response.create and every frame answering it, up to its last; each one validated."""
    frame = {"type": "response.create", "model": "openai/stub-model", **fields}
    if not any(isinstance(item, dict) and item.get("type") == "compaction_trigger" for item in fields.get("input") or []):
        conforming_ws_request(frame)  # Codex's trigger is no item of the specification
    await ws.send(json.dumps(frame))
    frames: list[dict[str, Any]] = []
    while True:
        frame = json.loads(await asyncio.wait_for(ws.recv(), 30))
        frames.append(frame)
        if frame["type"] == "error":
            conforming_ws_error(frame)
            return frames
        conforming_event(frame)
        if frame["type"] in ("response.completed", "response.failed", "response.incomplete"):
            assert [f["sequence_number"] for f in frames] == list(range(len(frames)))
            return frames


def final(frames: list[dict[str, Any]]) -> dict[str, Any]:
    assert frames[-1]["type"] == "response.completed", frames[-1]
    return frames[-1]["response"]


async def test_sequential_responses_chain_with_only_new_items(http: HttpDaemon, stub: StubOpenAI) -> None:
    stub.enqueue(Reply(calls=[{"id": "call_1", "name": "shell", "arguments": {"cmd": "ls"}}]), "two files", "bye")
    async with socket(http) as ws:
        first = final(await turn(ws, input=[user("list the files")], tools=[TOOL]))
        assert first["output"][0]["type"] == "function_call"
        second = final(await turn(ws, previous_response_id=first["id"], tools=[TOOL], input=[
            {"type": "function_call_output", "call_id": "call_1", "output": "a.txt b.txt"}]))
        assert second["output"][0]["content"][0]["text"] == "two files"
        third = final(await turn(ws, previous_response_id=second["id"], input=[user("thanks")]))
    # the provider was sent the whole conversation each time, rebuilt by KSI from only new items
    assert [m["role"] for m in stub.messages()] == ["user", "assistant", "tool", "assistant", "user"]
    assert first["conversation"]["id"] == second["conversation"]["id"] == third["conversation"]["id"]
    assert len(await stored_index(http.daemon, third["conversation"]["id"])) == 3


async def test_warm_up_returns_a_chainable_id_and_calls_no_model(http: HttpDaemon, stub: StubOpenAI) -> None:
    stub.enqueue("warm answer")
    async with socket(http) as ws:
        warm = await turn(ws, generate=False, instructions="be brief", input=[user("context first")])
        assert [f["type"] for f in warm] == ["response.created", "response.completed"]
        assert warm[-1]["response"]["output"] == [] and stub.requests == []
        answer = final(await turn(ws, previous_response_id=warm[-1]["response"]["id"], input=[user("now ask")]))
    assert answer["output"][0]["content"][0]["text"] == "warm answer"
    sent = stub.messages()
    assert sent[0] == {"role": "system", "content": "be brief"}
    assert [m["content"] for m in sent[1:]] == ["context first", "now ask"]
    async with socket(http) as ws:  # a warm-up is held by its socket only
        refused = await turn(ws, previous_response_id=warm[-1]["response"]["id"], input=[user("elsewhere")])
    assert refused[-1]["error"]["code"] == "previous_response_not_found"


async def test_store_false_is_held_for_the_connection_only(http: HttpDaemon, stub: StubOpenAI) -> None:
    async with socket(http) as ws:
        first = final(await turn(ws, store=False, input=[user("remember 7")]))
        assert first["store"] is False
        second = final(await turn(ws, store=False, previous_response_id=first["id"], input=[user("and 8")]))
        assert second["conversation"]["id"] == first["conversation"]["id"]
    async with socket(http) as ws:
        refused = await turn(ws, store=False, previous_response_id=second["id"], input=[user("and 9")])
        assert refused[-1]["type"] == "error" and refused[-1]["status"] == 404
        assert refused[-1]["error"]["code"] == "previous_response_not_found"
        assert refused[-1]["error"]["param"] == "previous_response_id"
        # recovering: the full context sent again, without the id, continues the same conversation
        history = [user("remember 7"), {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": first["output"][0]["content"][0]["text"]}]}, user("and 8"),
            {"type": "message", "role": "assistant", "content": [
                {"type": "output_text", "text": second["output"][0]["content"][0]["text"]}]}, user("and 9")]
        recovered = final(await turn(ws, store=False, input=history))
    assert recovered["conversation"]["id"] == first["conversation"]["id"]
    assert len(await stored_index(http.daemon, first["conversation"]["id"])) == 3


async def test_a_connection_local_response_is_not_chained_from_over_http(http: HttpDaemon) -> None:
    async with socket(http) as ws:
        local = final(await turn(ws, store=False, input=[user("only here")]))
        stored = final(await turn(ws, input=[user("everywhere")]))
    async with httpx.AsyncClient(base_url=http.base_url, headers={"Authorization": f"Bearer {http.token}"},
                                 timeout=30) as client:
        refused = await client.post("/v1/responses", json={"model": "openai/stub-model", "input": "next",
                                                           "previous_response_id": local["id"]})
        assert refused.status_code == 404 and refused.json()["error"]["code"] == "previous_response_not_found"
        chained = await client.post("/v1/responses", json={"model": "openai/stub-model", "input": "next",
                                                           "previous_response_id": stored["id"]})
    assert chained.status_code == 200 and chained.json()["conversation"]["id"] == stored["conversation"]["id"]


async def test_a_missing_previous_response_is_an_error_and_the_socket_goes_on(http: HttpDaemon) -> None:
    async with socket(http) as ws:
        refused = await turn(ws, previous_response_id="resp_openai-stub-model-000000000000", input=[user("hi")])
        assert refused[-1]["error"]["code"] == "previous_response_not_found"
        assert final(await turn(ws, input=[user("hi")]))["status"] == "completed"


async def test_a_failed_continuation_evicts_what_the_socket_held(http: HttpDaemon, stub: StubOpenAI) -> None:
    async with socket(http) as ws:
        first = final(await turn(ws, store=False, input=[user("start")]))
        stub.enqueue(Reply(status=400, body=json.dumps({"error": {"message": "bad", "type": "invalid_request_error"}})))
        failed = await turn(ws, store=False, previous_response_id=first["id"], input=[user("fails")])
        assert failed[-1]["type"] == "response.failed"
        refused = await turn(ws, store=False, previous_response_id=first["id"], input=[user("again")])
        assert refused[-1]["error"]["code"] == "previous_response_not_found"


async def test_bad_frames_get_error_events(http: HttpDaemon) -> None:
    async with socket(http) as ws:
        await ws.send("{not json")
        frame = json.loads(await ws.recv())
        conforming_ws_error(frame)
        assert frame["error"]["code"] == "invalid_json"
        for bad, code in (({"type": "response.cancel"}, "invalid_request"),
                          ({"type": "response.create", "input": []}, "validation_error"),
                          ({"type": "response.create", "input": "x", "background": True}, "unsupported_parameter"),
                          ({"type": "response.create", "input": "x", "generate": "false"}, "validation_error")):
            await ws.send(json.dumps(bad))
            frame = json.loads(await ws.recv())
            conforming_ws_error(frame)
            assert frame["error"]["code"] == code, frame
        assert final(await turn(ws, input=[user("still here")]))["status"] == "completed"


async def test_the_bearer_token_is_required(http: HttpDaemon) -> None:
    with pytest.raises(InvalidStatus) as refused:
        async with socket(http, token="wrong"):
            pass
    assert refused.value.response.status_code == 401
    assert json.loads(refused.value.response.body)["error"]["code"] == "unauthorized"


async def test_closing_the_socket_cancels_the_turn_and_gives_the_connection_back(
        http: HttpDaemon, stub: StubOpenAI) -> None:
    budget = http.daemon.connection_budget
    before = budget.held
    gate = asyncio.Event()
    stub.enqueue(Reply(text="never finished", gate=gate))
    ws = await socket(http)
    assert budget.held == before + 1
    await ws.send(json.dumps({"type": "response.create", "model": "openai/stub-model", "input": [user("long")]}))
    created = json.loads(await ws.recv())
    conversation = created["response"]["conversation"]["id"]
    while json.loads(await ws.recv())["type"] != "response.output_text.delta":
        pass
    await ws.close()
    for _ in range(500):
        if budget.held == before:
            break
        await asyncio.sleep(0.01)
    assert budget.held == before
    gate.set()
    assert await stored_index(http.daemon, conversation) == []  # cancelled: nothing was indexed


async def test_sockets_past_the_budget_are_refused(short_tmp: Path, stub: StubOpenAI, backend: dict[str, Any]) -> None:
    async with running_http_daemon(short_tmp, **stub_settings(stub), **backend, max_connections=8) as http:
        budget = http.daemon.connection_budget
        room = budget.cap - budget.local_room - budget.held
        open_sockets = [await socket(http) for _ in range(room)]
        with pytest.raises(InvalidStatus) as refused:
            await socket(http)
        assert refused.value.response.status_code == 503
        await open_sockets.pop().close()
        for _ in range(500):
            if budget.held < budget.cap - budget.local_room:
                break
            await asyncio.sleep(0.01)
        async with socket(http) as ws:
            assert final(await turn(ws, input=[user("in again")]))["status"] == "completed"
        for ws in open_sockets:
            await ws.close()


async def test_a_compaction_trigger_on_the_socket_is_answered_by_one_item(http: HttpDaemon, stub: StubOpenAI) -> None:
    async with socket(http) as ws:
        first = final(await turn(ws, input=[user("remember 5")]))
        calls = len(stub.requests)
        frames = await turn(ws, previous_response_id=first["id"], input=[{"type": "compaction_trigger"}])
        (item,) = final(frames)["output"]
        assert item["type"] == "compaction" and json.loads(item["encrypted_content"])["response_id"] == first["id"]
        replayed = final(await turn(ws, input=[item, user("what number?")]))
    assert len(stub.requests) == calls + 1
    assert replayed["conversation"]["id"] == first["conversation"]["id"]
    assert len(await stored_index(http.daemon, first["conversation"]["id"])) == 2


async def test_a_frame_past_the_size_limit_closes_the_socket(short_tmp: Path, stub: StubOpenAI,
                                                            backend: dict[str, Any]) -> None:
    async with running_http_daemon(short_tmp, **stub_settings(stub), **backend, line_limit=4096) as http:
        async with socket(http) as ws:
            await ws.send(json.dumps({"type": "response.create", "input": "x" * 8192}))
            with pytest.raises(ConnectionClosed) as closed:
                await asyncio.wait_for(ws.recv(), 10)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
        assert stub.requests == []
        async with socket(http) as ws:
            assert final(await turn(ws, input=[user("small")]))["status"] == "completed"


async def test_the_daemon_stops_with_a_socket_open(short_tmp: Path, stub: StubOpenAI, backend: dict[str, Any]) -> None:
    async with running_http_daemon(short_tmp, **stub_settings(stub), **backend) as http:
        ws = await socket(http)
        assert final(await turn(ws, input=[user("hello")]))["status"] == "completed"
    with pytest.raises(ConnectionClosed):
        await asyncio.wait_for(ws.recv(), 10)


async def test_a_socket_that_never_waits_for_answers_is_closed(http: HttpDaemon, stub: StubOpenAI) -> None:
    gate = asyncio.Event()
    stub.enqueue(Reply(text="slow", gate=gate))
    async with socket(http) as ws:
        for n in range(70):
            await ws.send(json.dumps({"type": "response.create", "model": "openai/stub-model", "input": f"n{n}"}))
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                await asyncio.wait_for(ws.recv(), 10)
    gate.set()
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1013
    assert len(stub.requests) <= 1  # the turn that ran was cancelled with its socket; none other started


async def test_a_socket_holds_its_newest_warm_ups(http: HttpDaemon, stub: StubOpenAI) -> None:
    async with socket(http) as ws:
        kept = final(await turn(ws, store=False, input=[user("kept")]))
        warm = [final(await turn(ws, generate=False, input=[user(f"warm {n}")]))["id"] for n in range(9)]
        forgotten = await turn(ws, previous_response_id=warm[0], input=[user("from the oldest")])
        assert forgotten[-1]["error"]["code"] == "previous_response_not_found"
        assert final(await turn(ws, previous_response_id=warm[1], input=[user("from the next")]))
        assert final(await turn(ws, store=False, previous_response_id=kept["id"], input=[user("still kept")]))
    assert stub.requests and len(stub.requests) == 3


async def test_a_browser_session_opens_a_socket_only_from_the_daemons_pages(http: HttpDaemon) -> None:
    root = http.daemon.http.sessions.root
    async with httpx.AsyncClient(base_url=http.base_url, timeout=30.0) as browser:
        assert (await browser.get("/login", params={"code": make_code(http.token)})).status_code == 303
        cookie = "; ".join(f"{name}={value}" for name, value in browser.cookies.items())
    url = ws_url(http).replace("/v1/responses", root + "/v1/responses")
    for origin in ("http://evil.example", None):
        headers = {"Cookie": cookie, **({"Origin": origin} if origin else {})}
        with pytest.raises(InvalidStatus) as refused:
            async with connect(url, additional_headers=headers, open_timeout=10):
                pass
        assert refused.value.response.status_code == 403
        assert json.loads(refused.value.response.body)["error"]["code"] == "cross_site_request"
    async with connect(url, additional_headers={"Cookie": cookie}, origin=http.base_url,  # type: ignore[arg-type]
                       open_timeout=10) as ws:
        assert final(await turn(ws, input=[user("from the console")]))["status"] == "completed"
