"""The OpenAI-compatible door under the one rule of every door: its sampling and format fields
reach the provider (the official `openai` SDK, real litellm, the local stub), what KSI cannot
honour is refused with `unsupported_parameter` naming the client's field, before anything is
written, and the values clients send by default pass."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from ksi_common.errors import ErrorCode
from tests.conftest import HttpDaemon, running_http_daemon, stub_settings
from tests.stub_openai import StubOpenAI
from tests.test_request_options import JSON_SCHEMA, PASSED, SCHEMA, sent, stored


def api(http: HttpDaemon) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=http.base_url, headers={"Authorization": f"Bearer {http.token}"}, timeout=30)


def sdk(http: HttpDaemon) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{http.base_url}/v1", api_key=http.token, max_retries=0)


# -- HTTP: Chat Completions ---------------------------------------------------------------------------

async def test_chat_completion_options_reach_the_provider(http_daemon: HttpDaemon, stub: StubOpenAI) -> None:
    async with sdk(http_daemon) as client:
        await client.chat.completions.create(
            model="openai/stub-model", messages=[{"role": "user", "content": "hi"}], n=1, max_completion_tokens=30,
            seed=7, stop=["END"], top_p=0.5, presence_penalty=0.25, frequency_penalty=-0.5, reasoning_effort="low",
            response_format=JSON_SCHEMA, logit_bias={"50256": -100}, user="u-1")  # type: ignore[arg-type]
        assert sent(stub, PASSED) == PASSED
        assert stub.requests[-1]["max_tokens"] == 30 and "n" not in stub.requests[-1]
        await client.chat.completions.create(model="openai/stub-model", messages=[{"role": "user", "content": "j"}],
                                             response_format={"type": "json_object"})
        assert stub.requests[-1]["response_format"] == {"type": "json_object"}


async def test_a_field_the_door_does_not_declare_goes_to_the_provider(
        http_daemon: HttpDaemon, stub: StubOpenAI) -> None:
    async with sdk(http_daemon) as client:
        await client.chat.completions.create(model="openai/stub-model", messages=[{"role": "user", "content": "hi"}],
                                             extra_body={"top_k": 5})
    assert stub.requests[-1]["top_k"] == 5


@pytest.mark.parametrize(("extra", "field"), [
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ({"function_call": {"name": "f"}}, "function_call"),
    ({"n": 2}, "n"),
    ({"logprobs": True}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
])
async def test_chat_completion_refusals(http_daemon: HttpDaemon, stub: StubOpenAI, extra: dict[str, Any],
                                        field: str) -> None:
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    async with api(http_daemon) as http:
        for messages in ([], history):  # with a history of its own, refused before it is imported
            reply = await http.post("/v1/chat/completions", json={
                "model": "openai/stub-model", "messages": [*messages, {"role": "user", "content": "hi"}], **extra})
            assert reply.status_code == 400
            error = reply.json()["error"]
            assert (error["code"], error["param"]) == (ErrorCode.UNSUPPORTED_PARAMETER, field)
            assert field in error["message"]
    assert stored(http_daemon.daemon) == [] and stub.requests == []


async def test_chat_history_with_legacy_function_calls_is_refused_before_it_is_imported(
        http_daemon: HttpDaemon, stub: StubOpenAI) -> None:
    async with api(http_daemon) as http:
        reply = await http.post("/v1/chat/completions", json={"model": "openai/stub-model", "messages": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
            {"role": "user", "content": "c"}]})
        result = await http.post("/v1/chat/completions", json={"model": "openai/stub-model", "messages": [
            {"role": "user", "content": "a"}, {"role": "function", "name": "f", "content": "42"}]})
    assert (reply.status_code, reply.json()["error"]["code"], reply.json()["error"]["param"]) == (
        400, ErrorCode.UNSUPPORTED_PARAMETER, "messages.1.function_call")
    assert (result.status_code, result.json()["error"]["code"], result.json()["error"]["param"]) == (
        400, ErrorCode.UNSUPPORTED_PARAMETER, "messages.1.role")
    assert stored(http_daemon.daemon) == [] and stub.requests == []


async def test_chat_completion_refuses_an_audio_part_with_the_sdk(http_daemon: HttpDaemon, stub: StubOpenAI) -> None:
    async with sdk(http_daemon) as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model="openai/stub-model", messages=[{"role": "user", "content": [
                {"type": "text", "text": "what is this?"},
                {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}])
    assert caught.value.code == ErrorCode.UNSUPPORTED_PARAMETER
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "messages.0.content.1.type"
    assert stored(http_daemon.daemon) == [] and stub.requests == []


async def test_chat_completion_defaults_of_clients_pass(http_daemon: HttpDaemon, stub: StubOpenAI) -> None:
    """What LangChain's ChatOpenAI and similar clients put in every body, tools or not."""
    async with api(http_daemon) as http:
        reply = await http.post("/v1/chat/completions", json={
            "model": "openai/stub-model", "messages": [{"role": "user", "content": "hi"}], "stream": False, "n": 1,
            "temperature": 0.7, "tools": [], "tool_choice": "auto", "parallel_tool_calls": True, "logprobs": False,
            "top_logprobs": None, "stop": None, "store": False, "stream_options": None, "user": None})
    assert reply.status_code == 200, reply.text
    assert not {"tools", "tool_choice", "parallel_tool_calls", "n", "logprobs", "stop", "user"} & set(stub.requests[-1])
    assert stub.requests[-1]["temperature"] == 0.7


# -- HTTP: Responses ----------------------------------------------------------------------------------

async def test_response_options_reach_the_provider(http_daemon: HttpDaemon, stub: StubOpenAI) -> None:
    text_format = {"type": "json_schema", "name": "place", "schema": SCHEMA, "strict": True}
    async with sdk(http_daemon) as client:
        await client.responses.create(
            model="openai/stub-model", input="hi", top_p=0.5, reasoning={"effort": "low"}, user="u-1",
            text={"format": text_format},  # type: ignore[typeddict-item]
            extra_body={"seed": 7, "stop": ["END"], "presence_penalty": 0.25, "frequency_penalty": -0.5,
                        "logit_bias": {"50256": -100}})
        assert sent(stub, PASSED) == PASSED
        await client.responses.create(model="openai/stub-model", input="j", text={"format": {"type": "json_object"}})
        assert stub.requests[-1]["response_format"] == {"type": "json_object"}
        await client.responses.create(model="openai/stub-model", input="t", text={"format": {"type": "text"}})
        assert "response_format" not in stub.requests[-1]


@pytest.mark.parametrize(("extra", "field"), [
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "what is this?"},
                                             {"type": "input_image", "file_id": "file-1"}]}]},
     "input.0.content.1.file_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]}]},
     "input.0.content.0.file_id"),
    ({"input": [{"role": "user", "content": "go"},
                {"type": "computer_call_output", "call_id": "call_1", "output": {}}]}, "input.1.type"),
])
async def test_response_refusals(http_daemon: HttpDaemon, stub: StubOpenAI, extra: dict[str, Any],
                                 field: str) -> None:
    async with api(http_daemon) as http:
        reply = await http.post("/v1/responses", json={"model": "openai/stub-model", "input": "hi", **extra})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert (error["code"], error["param"]) == (ErrorCode.UNSUPPORTED_PARAMETER, field)
    assert stored(http_daemon.daemon) == [] and stub.requests == []


async def test_a_schema_refusal_names_the_responses_field(short_tmp: Path, stub: StubOpenAI) -> None:
    settings = stub_settings(stub, models={"openai/stub-plain": {"api_base": stub.api_base,
                                                                 "supports_response_schema": False}})
    async with running_http_daemon(short_tmp, **settings) as http, sdk(http) as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.responses.create(model="openai/stub-plain", input="hi", text={"format": {
                "type": "json_schema", "name": "place", "schema": SCHEMA}})
        assert caught.value.code == ErrorCode.UNSUPPORTED_PARAMETER
        assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "text.format"
        assert stored(http.daemon) == [] and stub.requests == []


async def test_response_defaults_of_clients_pass(http_daemon: HttpDaemon, stub: StubOpenAI) -> None:
    async with api(http_daemon) as http:
        reply = await http.post("/v1/responses", json={
            "model": "openai/stub-model", "input": "hi", "store": True, "include": [], "truncation": "disabled",
            "tools": [], "tool_choice": "auto", "parallel_tool_calls": True, "background": False, "stream": False,
            "text": {"format": {"type": "text"}}, "reasoning": {"effort": None, "summary": None},
            "top_logprobs": 0, "metadata": {}})
    assert reply.status_code == 200, reply.text
    assert not {"tools", "tool_choice", "parallel_tool_calls", "background", "response_format", "store",
                "include", "truncation", "reasoning_effort", "top_logprobs"} & set(stub.requests[-1])


async def test_malformed_formats_name_the_clients_field(http_daemon: HttpDaemon, stub: StubOpenAI) -> None:
    async with api(http_daemon) as http:
        chat = await http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}})
        response = await http.post("/v1/responses", json={"input": "hi", "text": {"format": {"type": "json_schema"}}})
    assert (chat.status_code, chat.json()["error"]["code"], chat.json()["error"]["param"]) == (
        400, ErrorCode.VALIDATION_ERROR, "response_format.json_schema")
    assert (response.status_code, response.json()["error"]["code"], response.json()["error"]["param"]) == (
        400, ErrorCode.VALIDATION_ERROR, "text.format")
    assert stored(http_daemon.daemon) == [] and stub.requests == []


async def test_a_routing_option_with_a_chat_history_is_refused_before_the_history_is_written(
        http_daemon: HttpDaemon, stub: StubOpenAI) -> None:
    async with api(http_daemon) as http:
        reply = await http.post("/v1/chat/completions", json={
            "model": "openai/stub-model", "base_url": "http://127.0.0.1:9/v1",
            "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                         {"role": "user", "content": "c"}]})
    assert reply.status_code == 400
    assert (reply.json()["error"]["code"], reply.json()["error"]["param"]) == (ErrorCode.VALIDATION_ERROR, "base_url")
    assert stored(http_daemon.daemon) == [] and stub.requests == []
