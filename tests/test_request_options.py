"""Nothing a request asks is silently dropped: on the socket every sampling/format option of
completion:async reaches the provider (real litellm to the local stub), what KSI cannot honour
(tool calls, several answers, logprobs, its own streaming) is refused with `unsupported_parameter`
naming the field before anything is written, and a JSON schema goes only to a model not known to
be unable to follow it. The HTTP doors under the same rule: test_http_request_options.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ksi_common.errors import ErrorCode, KsiError
from ksi_daemon.daemon import Daemon
from ksi_daemon.providers.base import ModelAbilities
from ksi_daemon.providers.litellm_provider import LiteLLMProvider
from tests.conftest import complete, connected, make_settings, running_daemon, stub_settings
from tests.stub_openai import Reply, StubOpenAI

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
          "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}
PASSED = {"seed": 7, "stop": ["END"], "top_p": 0.5, "presence_penalty": 0.25, "frequency_penalty": -0.5,
          "reasoning_effort": "low", "response_format": JSON_SCHEMA, "logit_bias": {"50256": -100}, "user": "u-1"}


def stored(daemon: Daemon) -> list[str]:
    """Every conversation, response and metadata file of the var dir."""
    layout = daemon.layout
    roots = (layout.conversations_dir, layout.responses_dir, layout.conversation_meta_dir)
    return sorted(str(p) for root in roots if root.exists() for p in root.rglob("*") if p.is_file())


def sent(stub: StubOpenAI, names: Any) -> dict[str, Any]:
    return {name: stub.requests[-1].get(name) for name in names}


# -- the socket -----------------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
async def test_sampling_options_reach_the_provider_through_the_socket(
        stub_daemon: Daemon, stub: StubOpenAI, stream: bool) -> None:
    async with connected(stub_daemon) as client:
        await complete(client, prompt="hi", max_tokens=20, stream=stream, options=PASSED)
    assert stub.requests[-1].get("stream", False) is stream
    assert sent(stub, PASSED) == PASSED
    assert stub.requests[-1]["max_tokens"] == 20


@pytest.mark.parametrize(("options", "field"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ({"function_call": {"name": "f"}}, "function_call"),
    ({"n": 2}, "n"),
    ({"stream": True}, "stream"),
    ({"stream": False}, "stream"),
    ({"logprobs": True}, "logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),
])
async def test_refused_options_on_the_socket_write_nothing(
        stub_daemon: Daemon, stub: StubOpenAI, options: dict[str, Any], field: str) -> None:
    async with connected(stub_daemon) as client:
        for target in ({}, {"conversation_id": "brand-new", "create": True}):
            with pytest.raises(KsiError) as caught:
                await client.request("completion:async", {"prompt": "hi", "options": options, **target})
            assert caught.value.code == ErrorCode.UNSUPPORTED_PARAMETER
            assert list(caught.value.details["fields"]) == [f"options.{field}"]
            assert field in caught.value.message
    assert stored(stub_daemon) == [] and stub.requests == []


async def test_values_that_ask_for_nothing_pass_and_are_not_sent(stub_daemon: Daemon, stub: StubOpenAI) -> None:
    defaults = {"tools": [], "functions": [], "tool_choice": "none", "parallel_tool_calls": True, "n": 1,
                "logprobs": False, "top_logprobs": None, "seed": None}
    async with connected(stub_daemon) as client:
        await complete(client, prompt="hi", options=defaults)
    assert not set(defaults) & set(stub.requests[-1])


@pytest.mark.parametrize(("options", "field"), [
    ({"response_format": {"type": "json_schema"}}, "options.response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "options.response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!"}}},
     "options.response_format.json_schema.name"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "options.stop"),
    ({"presence_penalty": 3}, "options.presence_penalty"),
    ({"reasoning_effort": "extreme"}, "options.reasoning_effort"),
])
async def test_malformed_sampling_options_are_validation_errors(
        stub_daemon: Daemon, stub: StubOpenAI, options: dict[str, Any], field: str) -> None:
    async with connected(stub_daemon) as client:
        with pytest.raises(KsiError) as caught:
            await client.request("completion:async", {"prompt": "hi", "options": options})
    assert caught.value.code == ErrorCode.VALIDATION_ERROR
    assert list(caught.value.details["fields"]) == [field]
    assert stored(stub_daemon) == [] and stub.requests == []


# -- the model's abilities --------------------------------------------------------------------------

async def test_abilities_come_from_the_settings_then_from_litellm(short_tmp: Path) -> None:
    provider = LiteLLMProvider(make_settings(short_tmp, models={
        "openai/local-*": {"supports_response_schema": True, "supports_vision": False, "supports_pdf_input": False},
        "gpt-4o-mini": {"supports_response_schema": False}}))
    # litellm's model list knows gpt-4o; a declaration overrides it, key by key
    assert await provider.abilities("gpt-4o") == ModelAbilities(True, function_calling=True, vision=True,
                                                                pdf_input=True)
    assert (await provider.abilities("gpt-4o-mini")).response_schema is False
    assert (await provider.abilities("gpt-4o-mini")).function_calling is True
    assert await provider.abilities("openai/local-qwen") == ModelAbilities(True, vision=False, pdf_input=False)
    assert await provider.abilities("openai/nobody-knows") == ModelAbilities(None)


async def test_a_schema_to_a_model_declared_unable_is_refused(short_tmp: Path, stub: StubOpenAI) -> None:
    settings = stub_settings(stub, models={"openai/stub-plain": {"api_base": stub.api_base,
                                                                 "supports_response_schema": False}})
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        for target in ({"model": "openai/stub-plain"}, {"conversation_id": "brand-new", "create": True,
                                                        "model": "openai/stub-plain"}):
            with pytest.raises(KsiError) as caught:
                await client.request("completion:async",
                                     {"prompt": "hi", "options": {"response_format": JSON_SCHEMA}, **target})
            assert caught.value.code == ErrorCode.UNSUPPORTED_PARAMETER
            assert list(caught.value.details["fields"]) == ["options.response_format"]
        assert stored(daemon) == [] and stub.requests == []
        # a plain JSON object it is not declared unable to give
        await complete(client, prompt="hi", model="openai/stub-plain",
                       options={"response_format": {"type": "json_object"}})
        assert stub.requests[-1]["response_format"] == {"type": "json_object"}
        # an existing conversation continued without naming the model: checked against its model
        first = await complete(client, prompt="hi", model="openai/stub-plain")
        with pytest.raises(KsiError) as caught:
            await client.request("completion:async", {"prompt": "again", "conversation_id": first["conversation_id"],
                                                      "options": {"response_format": JSON_SCHEMA}})
        assert caught.value.code == ErrorCode.UNSUPPORTED_PARAMETER


async def test_an_undeclared_model_gets_the_schema_and_its_refusal_comes_back(
        stub_daemon: Daemon, stub: StubOpenAI) -> None:
    stub.enqueue(Reply(status=400, body='{"error": {"message": "response_format json_schema is not supported '
                                        'by this model", "type": "invalid_request_error", "code": null}}'))
    async with connected(stub_daemon) as client:
        with pytest.raises(KsiError) as caught:
            await complete(client, prompt="hi", options={"response_format": JSON_SCHEMA})
    assert stub.requests[-1]["response_format"] == JSON_SCHEMA
    assert caught.value.code == ErrorCode.PROVIDER_ERROR
    assert "json_schema is not supported by this model" in caught.value.message


async def test_the_abilities_of_the_most_recently_used_models_only_are_remembered(short_tmp: Path) -> None:
    from ksi_daemon.providers.litellm_provider import ABILITIES_KEPT

    provider = LiteLLMProvider(make_settings(short_tmp))
    for i in range(ABILITIES_KEPT + 1):  # names from requests: echo models need no litellm
        await provider.abilities(f"echo/m{i}")
    assert len(provider._abilities) == ABILITIES_KEPT
    assert "echo/m0" not in provider._abilities and f"echo/m{ABILITIES_KEPT}" in provider._abilities
