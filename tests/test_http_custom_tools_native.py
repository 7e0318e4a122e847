"""Custom tools sent as they are to an `openai/` model whose settings declare
`supports_custom_tools`, through the Responses door with the official `openai` SDK, real litellm
and the stub answering in OpenAI's chat form: the provider gets `{"type": "custom", ...}` tools,
its `custom` tool calls come back as `custom_tool_call` items with their input (whole or
streamed), and the history's custom calls are replayed in that form. The same conversation
continued on a model without the setting gets the call as the function it stands for."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest

from tests.conftest import HttpDaemon, running_http_daemon, stub_settings
from tests.stored import stored_index
from tests.stub_openai import Reply, StubOpenAI

pytestmark = pytest.mark.backends

PATCH = "*** Begin Patch\n*** Add File: a.txt\n+hello\n*** End Patch"
GRAMMAR: Any = {"type": "grammar", "syntax": "lark", "definition": "start: /.+/s"}
APPLY_PATCH: Any = {"type": "custom", "name": "apply_patch", "description": "edit files with a patch", "format": GRAMMAR}
LOOKUP: Any = {"type": "function", "name": "lookup", "description": "a customer by name",
               "parameters": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}
NATIVE = "openai/stub-native"


@pytest.fixture
async def http(short_tmp: Path, stub: StubOpenAI, backend: dict[str, Any]) -> AsyncIterator[HttpDaemon]:
    models = {NATIVE: {"api_base": stub.api_base, "supports_custom_tools": True}}
    async with running_http_daemon(short_tmp, **stub_settings(stub, models=models), **backend) as running:
        yield running



@pytest.mark.parametrize("stream", [False, True])
async def test_a_custom_tool_goes_as_it_is_and_its_call_comes_back_and_is_replayed(
        http: HttpDaemon, api: openai.AsyncOpenAI, stub: StubOpenAI, stream: bool) -> None:
    stub.enqueue(Reply(calls=[{"id": "call_p1", "name": "apply_patch", "input": PATCH}]), "Patched.")
    asked: dict[str, Any] = {"model": NATIVE, "input": "add a.txt", "tools": [APPLY_PATCH, LOOKUP]}
    if stream:
        async with api.responses.stream(**asked) as events:
            first = await events.get_final_response()
    else:
        first = await api.responses.create(**asked)
    assert stub.requests[-1]["tools"] == [
        {"type": "custom", "custom": {"name": "apply_patch", "description": "edit files with a patch", "format": GRAMMAR}},
        {"type": "function", "function": {"name": "lookup", "description": "a customer by name",
                                          "parameters": LOOKUP["parameters"]}}]
    [made] = first.output
    assert made.type == "custom_tool_call"
    assert (made.call_id, made.name, made.input) == ("call_p1", "apply_patch", PATCH)

    second = await api.responses.create(
        model=NATIVE, previous_response_id=first.id, tools=[APPLY_PATCH, LOOKUP],
        input=[{"type": "custom_tool_call_output", "call_id": "call_p1", "output": "Done: added a.txt"}])
    assert second.output_text == "Patched."
    called, answered = stub.messages()[-2:]
    assert called["tool_calls"] == [{"id": "call_p1", "type": "custom",
                                     "custom": {"name": "apply_patch", "input": PATCH}}]
    assert (answered["role"], answered["tool_call_id"], answered["content"]) == ("tool", "call_p1", "Done: added a.txt")
    [conversation] = {first.conversation.id, second.conversation.id}  # type: ignore[union-attr]
    assert len(await stored_index(http.daemon, conversation)) == 2


async def test_a_model_without_custom_tools_is_replayed_the_call_as_its_function(
        http: HttpDaemon, api: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    stub.enqueue(Reply(calls=[{"id": "call_p1", "name": "apply_patch", "input": PATCH}]), "Patched.")
    first = await api.responses.create(model=NATIVE, input="add a.txt", tools=[APPLY_PATCH])
    second = await api.responses.create(
        model="openai/stub-model", previous_response_id=first.id, tools=[APPLY_PATCH],
        input=[{"type": "custom_tool_call_output", "call_id": "call_p1", "output": "Done: added a.txt"}])
    assert second.output_text == "Patched."
    [given] = stub.requests[-1]["tools"]
    assert given["type"] == "function" and given["function"]["name"] == "apply_patch"
    called = stub.messages()[-2]
    assert called["tool_calls"][0]["type"] == "function"
    assert called["tool_calls"][0]["function"]["name"] == "apply_patch"
    assert orjson.loads(called["tool_calls"][0]["function"]["arguments"]) == {"input": PATCH}
