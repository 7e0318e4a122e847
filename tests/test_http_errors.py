"""Bad input at the HTTP door: each gets OpenAI's error object with KSI's code and the matching
status, and nothing is lost or written where it should not be."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from ksi_common.errors import ErrorCode
from ksi_common.jsonl import read_records
from ksi_common.records import read_response
from tests.conftest import HttpDaemon, running_http_daemon, stub_settings
from tests.stub_openai import Reply, StubOpenAI


def api(http: HttpDaemon) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=http.base_url, headers={"Authorization": f"Bearer {http.token}"}, timeout=30)


def written(http: HttpDaemon) -> set[str]:
    """Every file of the var dir's logs: what a refused request must not change."""
    logs = http.daemon.layout.logs_dir
    return {str(p.relative_to(logs)) for p in logs.rglob("*") if p.is_file() and "daemon" not in p.parts}


async def test_unknown_previous_response_id_is_404(http_daemon: HttpDaemon) -> None:
    async with openai.AsyncOpenAI(base_url=f"{http_daemon.base_url}/v1", api_key=http_daemon.token,
                                  max_retries=0) as client:
        with pytest.raises(openai.NotFoundError) as caught:
            await client.responses.create(input="hi", previous_response_id="openai-stub-model-0123456789ab")
    assert caught.value.code == ErrorCode.PREVIOUS_RESPONSE_NOT_FOUND
    assert written(http_daemon) == set()


async def test_conversation_and_previous_response_id_together_are_refused(http_daemon: HttpDaemon) -> None:
    async with api(http_daemon) as http:
        first = (await http.post("/v1/responses", json={"input": "one"})).json()
        before = written(http_daemon)
        reply = await http.post("/v1/responses", json={"input": "two", "previous_response_id": first["id"],
                                                       "conversation": first["conversation"]["id"]})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["code"] == ErrorCode.VALIDATION_ERROR and error["param"] == "previous_response_id"
    # in the body's own terms, without pydantic's words
    assert error["message"] == "invalid input: previous_response_id: give conversation or previous_response_id, not both"
    assert error["details"]["fields"] == {"previous_response_id": "give conversation or previous_response_id, not both"}
    assert written(http_daemon) == before


async def test_body_over_the_limit_is_413(short_tmp: Path, stub: StubOpenAI) -> None:
    async with running_http_daemon(short_tmp, **stub_settings(stub), line_limit=4096) as running, \
            api(running) as http:
        reply = await http.post("/v1/responses", json={"input": "x" * 5000})
        assert reply.status_code == 413
        assert reply.json()["error"]["code"] == ErrorCode.PAYLOAD_TOO_LARGE
        # a body that does not declare its length is cut off at the limit too
        async def chunks() -> Any:
            yield b'{"input": "'
            for _ in range(6):
                yield b"y" * 1000

        streamed = await http.post("/v1/chat/completions", content=chunks(), headers={"Content-Type": "application/json"})
        assert streamed.status_code == 413
        assert written(running) == set() and stub.requests == []


@pytest.mark.parametrize(("body", "param"), [
    ({"input": 3}, "input"),
    ({"input": "hi", "temperature": "hot"}, "temperature"),
    ({"input": "hi", "max_output_tokens": -1}, "max_output_tokens"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input.0.role"),
    ({"input": [{"role": "assistant", "content": "earlier answer"}, {"role": "user", "content": "x"}]},
     "input.0.role"),
    ({"input": "hi", "conversation": "../../etc"}, "conversation"),
    ({"input": "hi", "metadata": {"k": 1}}, "metadata.k"),
    ({"input": "   "}, "input"),
    ({}, "input"),
])
async def test_wrong_types_are_400_naming_the_field(http_daemon: HttpDaemon, body: dict[str, Any],
                                                    param: str) -> None:
    async with api(http_daemon) as http:
        reply = await http.post("/v1/responses", json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == ErrorCode.VALIDATION_ERROR and error["param"] == param, error
    assert written(http_daemon) == set()


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe", b"", b"[1, 2]"])
async def test_malformed_json_is_400(http_daemon: HttpDaemon, content: bytes) -> None:
    async with api(http_daemon) as http:
        for path in ("/v1/responses", "/v1/chat/completions", "/v1/conversations"):
            reply = await http.post(path, content=content, headers={"Content-Type": "application/json"})
            assert reply.status_code == 400
            assert reply.json()["error"]["code"] in (ErrorCode.INVALID_JSON, ErrorCode.INVALID_REQUEST)
    assert written(http_daemon) == set()


async def test_chat_rejects_tool_messages_and_a_bad_conversation_header(http_daemon: HttpDaemon) -> None:
    async with api(http_daemon) as http:
        tool = await http.post("/v1/chat/completions", json={"messages": [{"role": "tool", "content": "r"}]})
        assert tool.status_code == 400 and tool.json()["error"]["param"] == "messages.0.tool_call_id"
        assert tool.json()["error"]["code"] == ErrorCode.VALIDATION_ERROR
        # a tool message answering a call no conversation made: the engine finds no such call open
        orphan = await http.post("/v1/chat/completions", json={
            "messages": [{"role": "tool", "tool_call_id": "call_1", "content": "r"}]})
        assert orphan.status_code == 400 and orphan.json()["error"]["code"] == ErrorCode.VALIDATION_ERROR
        assert orphan.json()["error"]["param"] == "messages"  # the engine's `input`, in the client's terms
        header = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}]},
                                 headers={"X-KSI-Conversation-Id": "../x"})
        assert header.status_code == 400 and header.json()["error"]["param"] == "conversation_id"
    assert written(http_daemon) == set()


async def test_an_overloaded_daemon_answers_429_with_retry_after(short_tmp: Path, stub: StubOpenAI) -> None:
    stub.enqueue(Reply(text="slow", delay=1.0))
    async with running_http_daemon(short_tmp, **stub_settings(stub), max_queued=1) as running, \
            api(running) as http:
        slow = asyncio.create_task(http.post("/v1/responses", json={"input": "first"}))
        while not stub.requests:
            await asyncio.sleep(0.01)
        refused = await http.post("/v1/responses", json={"input": "second"})
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == ErrorCode.OVERLOADED
        assert (await slow).status_code == 200
        assert len(stub.requests) == 1


async def test_a_client_leaving_mid_stream_leaves_the_exchange_whole_or_absent(
        http_daemon: HttpDaemon, stub: StubOpenAI) -> None:
    stub.enqueue(Reply(text=" ".join(f"w{i}" for i in range(40)), drip=0.05))
    async with api(http_daemon) as http:
        async with http.stream("POST", "/v1/responses", json={"input": "long story", "stream": True}) as reply:
            assert reply.status_code == 200
            async for line in reply.aiter_lines():
                if line.startswith("event: response.output_text.delta"):
                    break  # the first words arrived: leave
    response_id = await _single_response_id(http_daemon)
    record = await _settled(http_daemon, response_id)
    assert record.outcome is not None  # logged with its outcome, never as a half
    conversation_id = record.inputs[0]["conversation_id"]
    index = read_records(http_daemon.daemon.layout.index_file(conversation_id))
    if record.ok:  # it finished before the cancel: recorded once
        assert [line["response_id"] for line in index] == [response_id]
    else:  # cancelled: not in history
        assert record.outcome["code"] == ErrorCode.CANCELLED
        assert index == []


async def _single_response_id(http: HttpDaemon) -> str:
    for _ in range(500):
        files = list(http.daemon.layout.responses_dir.glob("*.jsonl"))
        if files:
            assert len(files) == 1
            return files[0].stem
        await asyncio.sleep(0.02)
    raise AssertionError("no response file was written")


async def _settled(http: HttpDaemon, response_id: str) -> Any:
    for _ in range(500):
        record = read_response(http.daemon.layout.response_file(response_id))
        if record is not None and record.outcome is not None:
            return record
        await asyncio.sleep(0.02)
    raise AssertionError("the response never got its outcome")


async def test_nothing_is_written_outside_the_var_dir(short_tmp: Path, stub: StubOpenAI) -> None:
    async with running_http_daemon(short_tmp, **stub_settings(stub), http_token=None) as running, \
            api(running) as http:
        assert (await http.post("/v1/responses", json={"input": "hi"})).status_code == 200
        assert (await http.get("/v1/responses/..%2F..%2Fescape")).status_code in (400, 404)
    assert sorted(p.name for p in short_tmp.iterdir()) == ["var"]


async def test_a_model_no_provider_answers_to_is_the_clients_404_not_a_gateway_error(
        http_daemon: HttpDaemon) -> None:
    # once litellm is loaded the name is refused before anything is written; before, the call
    # refuses it and only the failed request's log is kept (test_model_faults)
    await http_daemon.daemon.litellm.ensure_loaded()
    async with api(http_daemon) as http:
        reply = await http.post("/v1/responses", json={"input": "hi", "model": "no-such-provider-model"})
    assert reply.status_code == 404
    assert reply.json()["error"]["code"] == ErrorCode.MODEL_NOT_FOUND
    assert written(http_daemon) == set()


async def test_a_stream_whose_provider_fails_ends_with_response_failed(http_daemon: HttpDaemon,
                                                                         stub: StubOpenAI) -> None:
    stub.enqueue(Reply(status=400))  # refused outright: no retry
    kinds: list[str] = []
    async with openai.AsyncOpenAI(base_url=f"{http_daemon.base_url}/v1", api_key=http_daemon.token,
                                  max_retries=0) as client:
        stream = await client.responses.create(model="openai/stub-model", input="hi", stream=True)
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.failed":
                assert event.response.error is not None
                # one of the API's codes (the SDK's types allow no other), KSI's own leading the message
                assert event.response.error.code == "server_error"
                assert event.response.error.message.startswith(f"{ErrorCode.PROVIDER_ERROR}: ")
    assert kinds[0] == "response.created" and kinds[-1] == "response.failed"
    assert "response.completed" not in kinds
    responses = list(http_daemon.daemon.layout.responses_dir.glob("*.jsonl"))
    record = read_response(responses[0])
    assert record is not None and record.outcome is not None and record.outcome["type"] == "error"
    conversation_id = record.inputs[0]["conversation_id"]
    assert read_records(http_daemon.daemon.layout.index_file(conversation_id)) == []  # never in history
