"""What Codex sends with every Responses request, through the official `openai` SDK: options that
are not secrets (prompt_cache_key, safety_identifier, client_metadata, service_tier, max_tool_calls,
truncation, parallel_tool_calls, text.verbosity), `include: ["reasoning.encrypted_content"]` and
`reasoning.summary` are accepted; the options reach a provider that takes them and are kept with
the exchange whatever the provider, on every storage backend. Credentials stay refused by name."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response

from ksi_common.errors import ErrorCode
from ksi_daemon.providers.options import is_routing_option
from tests.conftest import HttpDaemon, running_http_daemon, stub_settings
from tests.stored import stored_response
from tests.stub_openai import StubOpenAI
from tests.test_cli_provider import fake  # noqa: F401  (a fixture: the fake CLIs on PATH)
from tests.test_request_options import stored

pytestmark = pytest.mark.backends

CODEX_OPTIONS: dict[str, Any] = {
    "prompt_cache_key": "019a-session", "safety_identifier": "user-hash", "service_tier": "auto",
    "client_metadata": {"originator": "codex_exec"}, "max_tool_calls": 25}
TAKEN_BY_OPENAI = ("prompt_cache_key", "safety_identifier", "service_tier")  # litellm lists these for openai/


@pytest.fixture
async def http(short_tmp: Path, stub: StubOpenAI, backend: dict[str, Any]) -> AsyncIterator[HttpDaemon]:
    models = {"openai/gpt-5*": {"api_base": stub.api_base}}  # litellm lists verbosity for GPT-5 models only
    async with running_http_daemon(short_tmp, **stub_settings(stub, models=models), **backend) as running:
        yield running


def sdk(http: HttpDaemon) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{http.base_url}/v1", api_key=http.token, max_retries=0)


async def kept(http: HttpDaemon, response: Response) -> dict[str, Any]:
    lines = await stored_response(http.daemon, response.id.removeprefix("resp_"))
    assert lines is not None
    return lines[0].get("options") or {}


async def test_codex_options_pass_where_taken_and_are_kept(http: HttpDaemon, stub: StubOpenAI) -> None:
    async with sdk(http) as client:
        response = await client.responses.create(
            model="openai/stub-model", input="hi", include=["reasoning.encrypted_content"],
            reasoning={"effort": "low", "summary": "auto"}, parallel_tool_calls=True, truncation="auto",
            store=False, extra_body=CODEX_OPTIONS)
    assert response.status == "completed" and response.output_text == "stub answer to: hi"
    sent = stub.requests[-1]
    assert {name: sent.get(name) for name in TAKEN_BY_OPENAI} == {name: CODEX_OPTIONS[name] for name in TAKEN_BY_OPENAI}
    assert "client_metadata" not in sent and "max_tool_calls" not in sent  # no chat provider takes them
    assert sent["reasoning_effort"] == "low"
    assert await kept(http, response) == {**CODEX_OPTIONS, "truncation": "auto"}
    assert "truncation" not in sent
    assert response.prompt_cache_key == "019a-session" and response.safety_identifier == "user-hash"
    assert response.max_tool_calls == 25 and response.reasoning is not None
    assert response.reasoning.summary == "auto"


async def test_text_verbosity_passes_where_taken_and_is_kept(http: HttpDaemon, stub: StubOpenAI) -> None:
    async with sdk(http) as client:
        response = await client.responses.create(model="openai/gpt-5-stub", input="hi", text={"verbosity": "low"})
        assert stub.requests[-1]["verbosity"] == "low"
        assert await kept(http, response) == {"verbosity": "low"}
        assert response.text is not None and response.text.verbosity == "low"
        other = await client.responses.create(model="openai/stub-model", input="hi", text={"verbosity": "medium"})
        assert "verbosity" not in stub.requests[-1]
        assert await kept(http, other) == {"verbosity": "medium"}
        echoed = await client.responses.create(model="echo/demo", input="hi", text={"verbosity": "high"})
        assert await kept(http, echoed) == {"verbosity": "high"}


async def test_the_echo_model_takes_none_and_the_exchange_keeps_them(http: HttpDaemon) -> None:
    async with sdk(http) as client:
        response = await client.responses.create(model="echo/demo", input="hi", extra_body=CODEX_OPTIONS)
    assert response.status == "completed"
    assert await kept(http, response) == CODEX_OPTIONS


@pytest.mark.parametrize("include", [["message.output_text.logprobs"],
                                     ["reasoning.encrypted_content", "file_search_call.results"]])
async def test_include_other_than_reasoning_is_refused(http: HttpDaemon, stub: StubOpenAI, include: list[str]) -> None:
    async with httpx.AsyncClient(base_url=http.base_url, headers={"Authorization": f"Bearer {http.token}"}) as api:
        reply = await api.post("/v1/responses", json={"model": "openai/stub-model", "input": "hi", "include": include})
    assert reply.status_code == 400
    assert (reply.json()["error"]["code"], reply.json()["error"]["param"]) == (ErrorCode.UNSUPPORTED_PARAMETER, "include")
    assert include[-1] in reply.json()["error"]["message"]
    assert stored(http.daemon) == [] and stub.requests == []


@pytest.mark.parametrize("name", ["base_url", "extra_headers", "aws_secret_access_key", "vertex_credentials",
                                  "token", "azure_ad_token"])
async def test_credentials_stay_refused_by_name(http: HttpDaemon, stub: StubOpenAI, name: str) -> None:
    async with httpx.AsyncClient(base_url=http.base_url, headers={"Authorization": f"Bearer {http.token}"}) as api:
        reply = await api.post("/v1/responses", json={"model": "openai/stub-model", "input": "hi", name: "x"})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == name
    assert stored(http.daemon) == [] and stub.requests == []


def test_the_credential_rule_names_options_rather_than_suffixes() -> None:
    for name in ("prompt_cache_key", "safety_identifier", "max_tokens", "cache_key", "client_metadata"):
        assert not is_routing_option(name), name
    for name in ("api_key", "api_base", "aws_access_key_id", "vertex_project", "azure_ad_token", "access_token"):
        assert is_routing_option(name), name


@pytest.mark.usefixtures("fake")
async def test_a_cli_model_that_takes_no_options_still_keeps_codex_options(short_tmp: Path, backend: dict[str, Any]) -> None:
    async with running_http_daemon(short_tmp, **backend) as http, sdk(http) as client:
        response = await client.responses.create(model="claude-cli/sonnet", input="hi", extra_body=CODEX_OPTIONS)
        assert response.status == "completed"
        assert await kept(http, response) == CODEX_OPTIONS
        with pytest.raises(openai.BadRequestError) as caught:  # an option it would be sent: refused
            await client.responses.create(model="claude-cli/sonnet", input="hi", top_p=0.5)
        assert caught.value.code == ErrorCode.UNSUPPORTED_PARAMETER
