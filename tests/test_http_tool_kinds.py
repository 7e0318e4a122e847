"""Every tool a Responses client runs, through the official `openai` SDK against the stub (real
litellm, a provider that takes only functions): a custom tool is sent as a function with one string
argument and comes back as a `custom_tool_call` with its input; a namespace's functions keep their
names and come back with the namespace; Codex's `local_shell` and `shell` forms come back as their
calls; each is answered by its own output item, kept with the client's form, replayed to the
provider and matched when the client resends its history. Hosted tools are refused, or left out
for a model whose settings name them. On both storage backends."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from ksi_common.errors import ErrorCode
from ksi_daemon.providers.tool_kinds import CUSTOM_PARAMETERS
from tests.conftest import HttpDaemon, connected, running_http_daemon, stub_settings
from tests.stored import stored_index, stored_response
from tests.stub_openai import Reply, StubOpenAI
from tests.test_http_openai_tools import tool_turns
from tests.test_request_options import stored

pytestmark = pytest.mark.backends

PATCH = "*** Begin Patch\n*** Add File: a.txt\n+hello\n*** End Patch"
APPLY_PATCH: Any = {"type": "custom", "name": "apply_patch", "description": "edit files with a patch",
                    "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/s"}}
LOOKUP: Any = {"type": "function", "name": "lookup", "description": "a customer by name",
               "parameters": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}
CRM: Any = {"type": "namespace", "name": "crm", "description": "customer records", "tools": [LOOKUP]}


@pytest.fixture
async def http(short_tmp: Path, stub: StubOpenAI, backend: dict[str, Any]) -> AsyncIterator[HttpDaemon]:
    models = {"openai/stub-drops": {"api_base": stub.api_base, "drop_hosted_tools": ["web_search"]},
              "openai/stub-search": {"api_base": stub.api_base, "supports_web_search": True}}
    async with running_http_daemon(short_tmp, **stub_settings(stub, models=models), **backend) as running:
        yield running



def rid(response: Any) -> str:
    return str(response.id).removeprefix("resp_")


async def outcome(http: HttpDaemon, response: Any) -> dict[str, Any]:
    lines = await stored_response(http.daemon, rid(response))
    assert lines is not None
    return lines[-1]


async def first_input(http: HttpDaemon, response: Any) -> dict[str, Any]:
    lines = await stored_response(http.daemon, rid(response))
    assert lines is not None
    return lines[0]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_custom_tool_is_a_function_for_the_provider_and_a_custom_call_for_the_client(
        http: HttpDaemon, api: openai.AsyncOpenAI, stub: StubOpenAI, stream: bool) -> None:
    stub.enqueue(Reply(calls=[{"id": "call_p1", "name": "apply_patch", "arguments": {"input": PATCH}}]))
    if stream:
        async with api.responses.stream(model="openai/stub-model", input="add a.txt", tools=[APPLY_PATCH]) as events:
            first = await events.get_final_response()
    else:
        first = await api.responses.create(model="openai/stub-model", input="add a.txt", tools=[APPLY_PATCH])
    [given] = stub.requests[-1]["tools"]
    assert given["type"] == "function" and given["function"]["name"] == "apply_patch"
    assert given["function"]["parameters"] == CUSTOM_PARAMETERS
    assert "start: /.+/s" in given["function"]["description"]  # the grammar is shown to the model
    [made] = first.output
    assert made.type == "custom_tool_call"
    assert (made.call_id, made.name, made.input) == ("call_p1", "apply_patch", PATCH)
    assert (await outcome(http, first))["output"][0]["client_item"]["type"] == "custom_tool_call"

    second = await api.responses.create(
        model="openai/stub-model", previous_response_id=first.id, tools=[APPLY_PATCH],
        input=[{"type": "custom_tool_call_output", "call_id": "call_p1", "output": "Done: added a.txt"}])
    assert second.output_text == "stub answer to: add a.txt"
    assert tool_turns(stub)[-2:] == [("assistant", [("call_p1", "apply_patch", {"input": PATCH})]),
                                     ("tool", "call_p1", "Done: added a.txt")]
    kept = await first_input(http, second)
    assert (kept["type"], kept["client_type"], kept["output"]) == (
        "function_call_output", "custom_tool_call_output", "Done: added a.txt")
    [conversation] = {first.conversation.id, second.conversation.id}  # type: ignore[union-attr]
    assert len(await stored_index(http.daemon, conversation)) == 2


async def test_a_namespace_function_keeps_its_name_and_comes_back_in_its_namespace(
        http: HttpDaemon, api: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    stub.enqueue(Reply(calls=[{"id": "call_n1", "name": "lookup", "arguments": {"name": "Ada"}}]))
    first = await api.responses.create(model="openai/stub-model", input="find Ada", tools=[CRM])
    assert [tool["function"]["name"] for tool in stub.requests[-1]["tools"]] == ["lookup"]
    [made] = first.output
    assert (made.type, made.name, made.namespace, json.loads(made.arguments)) == (  # type: ignore[union-attr]
        "function_call", "lookup", "crm", {"name": "Ada"})
    assert first.tools[0].type == "namespace"  # echoed as the client sent it
    second = await api.responses.create(
        model="openai/stub-model", previous_response_id=first.id, tools=[CRM],
        input=[{"type": "function_call_output", "call_id": "call_n1", "output": "Ada Lovelace, London"}])
    assert second.output_text == "stub answer to: find Ada"
    assert tool_turns(stub)[-1] == ("tool", "call_n1", "Ada Lovelace, London")


async def test_shell_forms_come_back_as_their_calls_and_take_their_outputs(
        http: HttpDaemon, api: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    stub.enqueue(Reply(calls=[{"id": "call_l1", "name": "local_shell", "arguments": {"command": ["ls", "-a"]}}]))
    first = await api.responses.create(model="openai/stub-model", input="list files",
                                          tools=[{"type": "local_shell"}])
    assert stub.requests[-1]["tools"][0]["function"]["name"] == "local_shell"
    [made] = first.output
    assert made.type == "local_shell_call"
    assert (made.call_id, made.action.command, made.action.type) == ("call_l1", ["ls", "-a"], "exec")  # type: ignore[union-attr]
    stub.enqueue(Reply(calls=[{"id": "call_s1", "name": "shell", "arguments": {"commands": ["pwd"]}}]))
    second = await api.responses.create(
        model="openai/stub-model", previous_response_id=first.id, tools=[{"type": "shell"}],
        input=[{"type": "local_shell_call_output", "id": "call_l1", "output": ".\n..\na.txt"}])
    assert stub.requests[-1]["tools"][0]["function"]["name"] == "shell"
    assert tool_turns(stub)[-1] == ("tool", "call_l1", ".\n..\na.txt")
    [shell] = second.output
    assert shell.type == "shell_call" and shell.action.commands == ["pwd"]  # type: ignore[union-attr]
    result = [{"stdout": "/work\n", "stderr": "", "outcome": {"type": "exit", "exit_code": 0}}]
    third = await api.responses.create(
        model="openai/stub-model", previous_response_id=second.id, tools=[{"type": "shell"}],
        input=[{"type": "shell_call_output", "call_id": "call_s1", "output": result}])
    assert third.output_text == "stub answer to: list files"
    assert json.loads(tool_turns(stub)[-1][2]) == result
    kept = await first_input(http, third)
    assert (kept["client_type"], kept["client_output"]) == ("shell_call_output", result)


async def test_a_resent_history_with_client_calls_continues_one_conversation(
        http: HttpDaemon, api: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    """As Codex does with store false: every request resends the whole history, calls in their own forms."""
    stub.enqueue(Reply(calls=[{"id": "call_p1", "name": "apply_patch", "arguments": {"input": PATCH}}]))
    tools = [APPLY_PATCH, {"type": "local_shell"}]
    history: list[Any] = [{"role": "user", "content": "add a.txt"}]
    first = await api.responses.create(model="openai/stub-model", input=history, tools=tools, store=False)
    history += [item.model_dump(exclude_none=True) for item in first.output]
    history.append({"type": "custom_tool_call_output", "call_id": "call_p1", "output": "Done"})
    stub.enqueue(Reply(calls=[{"id": "call_l1", "name": "local_shell", "arguments": {"command": ["cat", "a.txt"]}}]))
    second = await api.responses.create(model="openai/stub-model", input=history, tools=tools, store=False)
    history += [item.model_dump(exclude_none=True) for item in second.output]
    history.append({"type": "local_shell_call_output", "id": "call_l1", "output": "hello"})
    third = await api.responses.create(model="openai/stub-model", input=history, tools=tools, store=False)
    assert third.output_text == "stub answer to: add a.txt"
    conversations = {r.conversation.id for r in (first, second, third)}  # type: ignore[union-attr]
    assert len(conversations) == 1
    assert len(await stored_index(http.daemon, conversations.pop())) == 3
    assert [turn[0] for turn in tool_turns(stub)] == ["user", "assistant", "tool", "assistant", "tool"]


async def test_hosted_tools_are_dropped_only_where_the_model_settings_say(
        http: HttpDaemon, api: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    answer = await api.responses.create(model="openai/stub-drops", input="hi",
                                           tools=[LOOKUP, {"type": "web_search"}])
    assert answer.output_text == "stub answer to: hi"
    assert [tool["function"]["name"] for tool in stub.requests[-1]["tools"]] == ["lookup"]
    sent = len(stub.requests)
    with pytest.raises(openai.BadRequestError) as caught:
        await api.responses.create(model="openai/stub-model", input="hi", tools=[LOOKUP, {"type": "web_search"}])
    assert caught.value.code == ErrorCode.UNSUPPORTED_PARAMETER
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "tools.1.type"
    assert "drop_hosted_tools" in caught.value.message
    assert len(stub.requests) == sent


@pytest.mark.parametrize(("tools", "param"), [
    ([{"type": "custom", "name": "bad name"}], "tools.0"),
    ([{"type": "namespace", "name": "ns", "tools": [LOOKUP, {"type": "custom", "name": "lookup"}]}], "tools"),
    ([CRM, {**CRM, "tools": [{**LOOKUP, "name": "other"}]}], "tools"),  # two namespaces of one name
    ([{"type": "namespace", "name": "ns", "tools": []}], "tools.0"),
])
async def test_malformed_client_tools_are_refused_before_anything_is_written(
        http: HttpDaemon, stub: StubOpenAI, tools: list[Any], param: str) -> None:
    async with httpx.AsyncClient(base_url=http.base_url, headers={"Authorization": f"Bearer {http.token}"}) as api:
        reply = await api.post("/v1/responses", json={"model": "openai/stub-model", "input": "hi", "tools": tools})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["code"] == ErrorCode.VALIDATION_ERROR
    assert reply.json()["error"]["param"].startswith(param)
    assert stored(http.daemon) == [] and stub.requests == []


async def test_stored_items_are_listed_in_the_clients_forms(
        http: HttpDaemon, api: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    stub.enqueue(Reply(calls=[{"id": "call_p1", "name": "apply_patch", "arguments": {"input": PATCH}}]))
    first = await api.responses.create(model="openai/stub-model", input="add a.txt", tools=[APPLY_PATCH])
    second = await api.responses.create(
        model="openai/stub-model", previous_response_id=first.id, tools=[APPLY_PATCH],
        input=[{"type": "custom_tool_call_output", "call_id": "call_p1", "output": "Done"}])
    [listed] = (await api.responses.input_items.list(second.id)).data
    assert (listed.type, listed.call_id, listed.output) == ("custom_tool_call_output", "call_p1", "Done")  # type: ignore[union-attr]
    retrieved = await api.responses.retrieve(first.id)
    assert [(item.type, item.input) for item in retrieved.output] == [("custom_tool_call", PATCH)]  # type: ignore[union-attr]
    items = (await api.conversations.items.list(first.conversation.id, order="asc")).data  # type: ignore[union-attr]
    assert [item.type for item in items] == ["message", "custom_tool_call", "custom_tool_call_output", "message"]


async def test_export_and_import_keep_the_clients_forms(
        http: HttpDaemon, api: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    stub.enqueue(Reply(calls=[{"id": "call_p1", "name": "apply_patch", "arguments": {"input": PATCH}}]))
    first = await api.responses.create(model="openai/stub-model", input="add a.txt", tools=[APPLY_PATCH])
    await api.responses.create(
        model="openai/stub-model", previous_response_id=first.id, tools=[APPLY_PATCH],
        input=[{"type": "custom_tool_call_output", "call_id": "call_p1", "output": "Done"}])
    async with connected(http.daemon) as socket:
        exported = await socket.request("conversation:export",
                                        {"conversation_id": first.conversation.id, "format": "json"})  # type: ignore[union-attr]
        imported = await socket.request("conversation:import", {"data": exported["content"]})
    items = (await api.conversations.items.list(imported["conversation_id"], order="asc")).data
    assert [item.type for item in items] == ["message", "custom_tool_call", "custom_tool_call_output", "message"]
    assert items[1].input == PATCH  # type: ignore[union-attr]


async def test_chat_completions_custom_tools_in_the_chat_form(
        http: HttpDaemon, api: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    tool: Any = {"type": "custom", "custom": {"name": "apply_patch", "description": "edit files"}}
    stub.enqueue(Reply(calls=[{"id": "call_c1", "name": "apply_patch", "arguments": {"input": PATCH}}]))
    messages: list[Any] = [{"role": "user", "content": "add a.txt"}]
    first = await api.chat.completions.create(model="openai/stub-model", messages=messages, tools=[tool])
    assert stub.requests[-1]["tools"][0]["function"]["parameters"] == CUSTOM_PARAMETERS
    [made] = first.choices[0].message.tool_calls or []
    assert (made.type, made.id, made.custom.name, made.custom.input) == (  # type: ignore[union-attr]
        "custom", "call_c1", "apply_patch", PATCH)
    # the client's own history, resent with the call in its chat form
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": "call_c1", "content": "Done"}]
    second = await api.chat.completions.create(model="openai/stub-model", messages=messages, tools=[tool])
    assert second.choices[0].message.content == "stub answer to: add a.txt"
    assert tool_turns(stub)[-2:] == [("assistant", [("call_c1", "apply_patch", {"input": PATCH})]),
                                     ("tool", "call_c1", "Done")]
    assert (first.model_extra or {})["conversation_id"] == (second.model_extra or {})["conversation_id"]


async def test_a_web_search_goes_to_a_model_that_searches_itself(
        http: HttpDaemon, api: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    search: Any = {"type": "web_search", "search_context_size": "low",
                   "user_location": {"type": "approximate", "city": "Oslo", "country": "NO"}}
    answer = await api.responses.create(model="openai/stub-search", input="news?", tools=[LOOKUP, search])
    assert answer.output_text == "stub answer to: news?"
    sent = stub.requests[-1]
    assert sent["web_search_options"] == {"search_context_size": "low",
                                          "user_location": {"type": "approximate",
                                                            "approximate": {"city": "Oslo", "country": "NO"}}}
    assert [tool["function"]["name"] for tool in sent["tools"]] == ["lookup"]
    count = len(stub.requests)
    for model, tool, param in (("openai/stub-model", search, "tools.1.type"),  # not known to search
                               ("openai/stub-search", {"type": "web_search", "external_web_access": False},
                                "tools.1.external_web_access")):
        with pytest.raises(openai.BadRequestError) as caught:
            await api.responses.create(model=model, input="news?", tools=[LOOKUP, tool])
        assert caught.value.code == ErrorCode.UNSUPPORTED_PARAMETER
        assert isinstance(caught.value.body, dict) and caught.value.body["param"] == param
    assert len(stub.requests) == count


async def test_two_namespaces_may_hold_the_same_name(
        http: HttpDaemon, api: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    """Each keeps its own name where it is the only one; a name two namespaces share is qualified
    for the provider, and the call comes back under its own name and namespace."""
    billing: Any = {"type": "namespace", "name": "billing", "tools": [LOOKUP]}
    tools = [CRM, billing, APPLY_PATCH]
    stub.enqueue(Reply(calls=[{"id": "call_b1", "name": "billing__lookup", "arguments": {"name": "Ada"}}]))
    history: list[Any] = [{"role": "user", "content": "Ada's invoices"}]
    first = await api.responses.create(model="openai/stub-model", input=history, tools=tools, store=False)
    assert [tool["function"]["name"] for tool in stub.requests[-1]["tools"]] == [
        "crm__lookup", "billing__lookup", "apply_patch"]
    [made] = first.output
    assert (made.type, made.name, made.namespace) == ("function_call", "lookup", "billing")  # type: ignore[union-attr]
    history += [made.model_dump(exclude_none=True),
                {"type": "function_call_output", "call_id": "call_b1", "output": "2 invoices"}]
    second = await api.responses.create(model="openai/stub-model", input=history, tools=tools, store=False)
    assert second.conversation.id == first.conversation.id  # type: ignore[union-attr]
    assert tool_turns(stub)[-2:] == [("assistant", [("call_b1", "billing__lookup", {"name": "Ada"})]),
                                     ("tool", "call_b1", "2 invoices")]


async def test_chat_completions_refuse_a_web_search_tool(http: HttpDaemon, stub: StubOpenAI) -> None:
    async with httpx.AsyncClient(base_url=http.base_url, headers={"Authorization": f"Bearer {http.token}"}) as api:
        reply = await api.post("/v1/chat/completions", json={
            "model": "openai/stub-search", "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "web_search"}]})
    assert reply.status_code == 400
    assert (reply.json()["error"]["code"], reply.json()["error"]["param"]) == (
        ErrorCode.UNSUPPORTED_PARAMETER, "tools.0.type")
    assert stored(http.daemon) == [] and stub.requests == []
