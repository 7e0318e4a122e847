"""Tool-using conversations end to end through the socket, real litellm and the local stub: calls
and their outputs kept as exchanges of items, replayed in the provider's format (OpenAI chat and
Anthropic Messages), across a restart, a fork and a budget that must leave a tool turn out; bad
input refused with its code before anything is written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ksi_common.client import KsiClient
from ksi_common.errors import ErrorCode, KsiError
from ksi_daemon.daemon import Daemon
from tests.conftest import complete, connected, running_daemon, stub_settings
from tests.stored import stored_index, stored_response, stored_snapshot
from tests.stub_openai import Reply, StubOpenAI, served_from_a_thread

WEATHER = {"type": "function", "name": "weather", "description": "today's weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CLOCK = {"type": "function", "function": {"name": "clock", "description": "the time in a city",
                                          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TOOLS = [WEATHER, CLOCK]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}, CLOCK]


def output(call_id: str, text: str) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": text}


def calls_of(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [item for item in result["output"] if item["type"] == "function_call"]


def roles(messages: list[dict[str, Any]]) -> list[str]:
    return [m["role"] for m in messages if m["role"] != "system"]


async def loop_step_one(client: KsiClient, stub: StubOpenAI, conversation_id: str = "tools") -> dict[str, Any]:
    stub.enqueue(Reply(calls=[{"id": "call_a", "name": "weather", "arguments": {"city": "Oslo"}}]))
    return await complete(client, prompt="Weather in Oslo, and then Bergen's weather and time?", tools=TOOLS,
                          conversation_id=conversation_id, create=True)


# -- the loop ---------------------------------------------------------------------------------------

@pytest.mark.backends
@pytest.mark.parametrize("stream", [False, True])
async def test_a_three_step_tool_loop_is_one_conversation_in_order(
        stub_daemon: Daemon, stub: StubOpenAI, stream: bool) -> None:
    async with connected(stub_daemon) as client:
        await client.request("monitor:subscribe", {"patterns": ["completion:chunk"]})
        stub.enqueue(Reply(calls=[{"id": "call_a", "name": "weather", "arguments": {"city": "Oslo"}}]))
        first = await complete(client, prompt="Weather in Oslo, then Bergen's weather and time?", tools=TOOLS,
                               tool_choice="auto", parallel_tool_calls=True, stream=stream,
                               conversation_id="tools", create=True)
        chunks = []
        while stream and (push := await client.next_push(timeout=5)) is not None:
            chunks.append(push["data"])
            if push["data"]["request_id"] == first["request_id"] and len(chunks) == 2:
                break
        stub.enqueue(Reply(calls=[{"id": "call_b", "name": "weather", "arguments": {"city": "Bergen"}},
                                  {"id": "call_c", "name": "clock", "arguments": {"city": "Bergen"}}]))
        second = await complete(client, input=[output("call_a", "12C, rain")], tools=TOOLS, stream=stream,
                                conversation_id="tools")
        stub.enqueue(Reply(text="Oslo 12C and rain; Bergen 9C at 14:05."))
        third = await complete(client, input=[output("call_c", "14:05"), output("call_b", "9C")], tools=TOOLS,
                               stream=stream, conversation_id="tools")

    assert first["finish_reason"] == second["finish_reason"] == "tool_calls"
    assert first["content"] == "" and calls_of(first) == [
        {"type": "function_call", "call_id": "call_a", "name": "weather", "arguments": '{"city": "Oslo"}'}]
    assert [(c["call_id"], c["name"]) for c in calls_of(second)] == [("call_b", "weather"), ("call_c", "clock")]
    assert third["content"] == "Oslo 12C and rain; Bergen 9C at 14:05." and third["finish_reason"] == "stop"
    assert third["output"] == [{"type": "message", "role": "assistant", "content": third["content"]}]
    assert [r["exchange"] for r in (first, second, third)] == [1, 2, 3]
    if stream:  # the call arrived in pieces, the arguments as deltas that add up
        pieces = [c["tool_call"] for c in chunks if "tool_call" in c]
        assert {p["call_id"] for p in pieces} == {"call_a"} and pieces[0]["name"] == "weather"
        assert "".join(p["arguments"] for p in pieces) == '{"city": "Oslo"}'

    # what the provider was sent: tools in the chat form, calls then their outputs, in order
    assert stub.requests[0]["tools"] == CHAT_TOOLS and stub.requests[0]["tool_choice"] == "auto"
    assert stub.requests[0]["parallel_tool_calls"] is True
    sent = stub.requests[2]["messages"]
    assert roles(sent) == ["user", "assistant", "tool", "assistant", "tool", "tool"]
    assert sent[1]["tool_calls"] == [{"id": "call_a", "type": "function",
                                      "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]
    assert sent[2] == {"role": "tool", "tool_call_id": "call_a", "content": "12C, rain"}
    assert [c["id"] for c in sent[3]["tool_calls"]] == ["call_b", "call_c"]
    assert [(m["tool_call_id"], m["content"]) for m in sent[4:]] == [("call_c", "14:05"), ("call_b", "9C")]

    # kept as one conversation: three exchanges, each record's items in order
    index = await stored_index(stub_daemon, "tools")
    assert [e["response_id"] for e in index] == [first["response_id"], second["response_id"], third["response_id"]]
    lines = await stored_response(stub_daemon, second["response_id"])
    assert lines is not None
    assert [(line["type"], line.get("call_id")) for line in lines] == [("function_call_output", "call_a"),
                                                                         ("assistant", None)]
    assert [i["call_id"] for i in lines[-1]["output"]] == ["call_b", "call_c"]


@pytest.mark.backends
async def test_a_restart_in_the_middle_of_the_loop(short_tmp: Path, stub: StubOpenAI,
                                                   backend: dict[str, Any]) -> None:
    settings = stub_settings(stub, **backend)
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        first = await loop_step_one(client, stub)
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        # the first turn's result, asked for again after the restart, still holds the call
        again = await client.request("completion:wait", {"request_id": first["request_id"], "timeout": 5})
        assert again["recovered"] is True and calls_of(again) == calls_of(first)
        # the new daemon knows the open call from storage alone: a plain prompt is refused...
        with pytest.raises(KsiError) as caught:
            await client.request("completion:async", {"prompt": "never mind", "conversation_id": "tools"})
        assert caught.value.code == ErrorCode.VALIDATION_ERROR and caught.value.details["call_ids"] == ["call_a"]
        # ...and the loop goes on
        stub.enqueue(Reply(text="12C in Oslo."))
        second = await complete(client, input=[output("call_a", "12C")], tools=TOOLS, conversation_id="tools")
    assert second["exchange"] == 2 and first["conversation_id"] == second["conversation_id"]
    sent = stub.requests[-1]["messages"]
    assert roles(sent) == ["user", "assistant", "tool"]
    assert sent[1]["tool_calls"][0]["id"] == "call_a" and sent[2]["tool_call_id"] == "call_a"


@pytest.mark.backends
async def test_a_fork_before_the_tool_call_continues_without_it(stub_daemon: Daemon, stub: StubOpenAI) -> None:
    async with connected(stub_daemon) as client:
        start = await complete(client, prompt="Hello", conversation_id="tools", create=True)
        stub.enqueue(Reply(calls=[{"id": "call_a", "name": "weather", "arguments": {"city": "Oslo"}}]))
        await complete(client, prompt="Weather in Oslo?", tools=TOOLS, conversation_id="tools")
        fork = await client.request("conversation:fork", {"conversation_id": "tools", "at": 1, "new_id": "early"})
        in_fork = await complete(client, prompt="Tell me a joke", conversation_id=fork["conversation_id"])
        # previous_response_id at the exchange before the call: a fork too, where no call is open
        after = await complete(client, prompt="Another one", previous_response_id=start["response_id"])
        # the fork's own answers to the call are refused: it never made it
        with pytest.raises(KsiError) as caught:
            await client.request("completion:async", {"input": [output("call_a", "12C")], "conversation_id": "early"})
    assert caught.value.code == ErrorCode.VALIDATION_ERROR and caught.value.details["call_ids"] == ["call_a"]
    assert in_fork["exchange"] == 2 and after["conversation_id"] not in ("tools", "early")
    for body in (stub.requests[2], stub.requests[3]):
        assert roles(body["messages"]) == ["user", "assistant", "user"]
        assert not any("tool_calls" in m for m in body["messages"])


@pytest.mark.backends
@pytest.mark.parametrize("stream", [False, True])
async def test_a_conversation_continues_on_an_anthropic_model_with_tool_use_blocks(
        short_tmp: Path, stub: StubOpenAI, backend: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
        stream: bool) -> None:
    monkeypatch.setenv("KSI_TEST_ANTHROPIC_KEY", "sk-ant-stub")
    anthropic = {"api_base": f"http://127.0.0.1:{stub.port}", "api_key_env": "KSI_TEST_ANTHROPIC_KEY"}
    settings = stub_settings(stub, models={"anthropic/stub*": anthropic}, **backend)
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        await loop_step_one(client, stub)
        # the outputs go to a Claude-style model, which calls another tool in its own format
        stub.enqueue(Reply(calls=[{"id": "toolu_b", "name": "clock", "arguments": {"city": "Bergen"}}]))
        second = await complete(client, input=[output("call_a", "12C")], tools=TOOLS, model="anthropic/stub-claude",
                                conversation_id="tools", stream=stream)
        # and back on the OpenAI-style model for the last step
        stub.enqueue(Reply(text="Done."))
        third = await complete(client, input=[output("toolu_b", "14:05")], tools=TOOLS,
                               model="openai/stub-model", conversation_id="tools")
    body = stub.anthropic_requests[-1]
    assert [tool["name"] for tool in body["tools"]] == ["weather", "clock"]
    assert body["tools"][0]["input_schema"] == WEATHER["parameters"]
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user"]
    assert body["messages"][1]["content"] == [{"type": "tool_use", "id": "call_a", "name": "weather",
                                               "input": {"city": "Oslo"}}]
    assert body["messages"][2]["content"] == [{"type": "tool_result", "tool_use_id": "call_a", "content": "12C"}]
    assert calls_of(second) == [{"type": "function_call", "call_id": "toolu_b", "name": "clock",
                                 "arguments": '{"city": "Bergen"}'}]
    assert second["finish_reason"] == "tool_calls" and third["content"] == "Done."
    sent = [m for m in stub.requests[-1]["messages"] if m["role"] != "system"]  # a note names both models
    assert roles(sent) == ["user", "assistant", "tool", "assistant", "tool"]
    assert sent[3]["tool_calls"][0]["id"] == "toolu_b" and sent[4]["tool_call_id"] == "toolu_b"


async def test_a_conversation_continues_on_an_ollama_model_with_its_tool_calls(short_tmp: Path) -> None:
    with served_from_a_thread(StubOpenAI()) as stub:
        await ollama_loop(short_tmp, stub)


async def ollama_loop(short_tmp: Path, stub: StubOpenAI) -> None:
    settings = stub_settings(stub, models={"ollama_chat/stub*": {"api_base": f"http://127.0.0.1:{stub.port}"}})
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        await loop_step_one(client, stub)
        stub.enqueue(Reply(calls=[{"name": "clock", "arguments": {"city": "Bergen"}}]))
        second = await complete(client, input=[output("call_a", "12C")], tools=TOOLS, model="ollama_chat/stub-llama",
                                conversation_id="tools")
        (call,) = calls_of(second)  # Ollama names no call: litellm gives it an id, kept as any other
        stub.enqueue(Reply(text="Done."))
        third = await complete(client, input=[output(call["call_id"], "14:05")], tools=TOOLS,
                               model="openai/stub-model", conversation_id="tools")
    body = stub.ollama_requests[-1]
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "tool"]
    assert body["messages"][1]["tool_calls"] == [{"function": {"name": "weather", "arguments": {"city": "Oslo"}}}]
    assert body["messages"][2]["content"] == "12C"
    assert [tool["function"]["name"] for tool in body["tools"]] == ["weather", "clock"]
    assert call["name"] == "clock" and json.loads(call["arguments"]) == {"city": "Bergen"} and call["call_id"]
    assert third["content"] == "Done."
    sent = [m for m in stub.requests[-1]["messages"] if m["role"] != "system"]
    assert roles(sent) == ["user", "assistant", "tool", "assistant", "tool"]
    assert sent[3]["tool_calls"][0]["id"] == sent[4]["tool_call_id"] == call["call_id"]


async def test_json_schema_and_sampling_fields_reach_the_stub(stub_daemon: Daemon, stub: StubOpenAI) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    fields = {"seed": 7, "stop": ["END"], "top_p": 0.5, "presence_penalty": 0.5, "frequency_penalty": -0.5,
              "reasoning_effort": "low",
              "response_format": {"type": "json_schema", "json_schema": {"name": "place", "schema": schema,
                                                                          "strict": True}}}
    stub.enqueue(Reply(text='{"city": "Oslo"}', reasoning="the user named Oslo"))
    async with connected(stub_daemon) as client:
        result = await complete(client, prompt="Where?", **fields)
    assert {name: stub.requests[-1].get(name) for name in fields} == fields
    assert result["output"] == [{"type": "reasoning", "summary": "the user named Oslo"},
                                {"type": "message", "role": "assistant", "content": '{"city": "Oslo"}'}]


async def test_the_oldest_tool_turn_leaves_with_its_output_and_the_summary_names_the_call(
        short_tmp: Path, stub: StubOpenAI) -> None:
    small = "openai/stub-small"
    settings = stub_settings(stub, models={small: {"api_base": stub.api_base, "context_window": 700,
                                                   "output_reserve": 100}},
                             calibration=False, summariser="openai/stub-model", default_model=small)
    filler = "Please keep in mind that the sky was rather grey and the streets were quiet that morning. " * 8
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        stub.enqueue(Reply(calls=[{"id": "call_first", "name": "weather", "arguments": {"city": "Tromso"}}]))
        await complete(client, prompt="What is the weather in Tromso?", tools=TOOLS,
                       conversation_id="long", create=True)
        stub.enqueue(Reply(text="It is cold in Tromso."))
        await complete(client, input=[output("call_first", "minus 12C " + filler)], tools=TOOLS,
                       conversation_id="long")
        for turn in range(4):
            stub.enqueue(Reply(text=f"Noted, turn {turn}."))
            await complete(client, prompt=f"{filler} turn {turn}", conversation_id="long")
        stub.enqueue(Reply(text="Last."))
        last = await complete(client, prompt="And now?", conversation_id="long")
    sent = [body for body in stub.requests if body["model"] == "stub-small"][-1]["messages"]
    assert last["history"]["summary_upto"] >= 2  # exchanges 1 (the call) and 2 (its output) are left out
    # the call and its output left together: neither side is in what was sent...
    assert not any(m.get("tool_calls") or m["role"] == "tool" for m in sent)
    assert "minus 12C" not in json.dumps(sent[1:])
    # ...and what stands in for them says the tool was called
    assert sent[0]["role"] == "system" and "weather" in sent[0]["content"] and "call_first" in sent[0]["content"]


async def test_outputs_whose_call_no_longer_fits_are_context_window_exceeded(short_tmp: Path,
                                                                            stub: StubOpenAI) -> None:
    small = "openai/stub-small"
    settings = stub_settings(stub, models={small: {"api_base": stub.api_base, "context_window": 700,
                                                   "output_reserve": 100}},
                             calibration=False, summariser="off", default_model=small)
    long_arguments = {"notes": "the quick brown fox jumps over the lazy dog " * 60}
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        stub.enqueue(Reply(calls=[{"id": "call_big", "name": "weather", "arguments": long_arguments}]))
        await complete(client, prompt="Weather?", tools=TOOLS, conversation_id="big", create=True)
        with pytest.raises(KsiError) as caught:
            await complete(client, input=[output("call_big", "12C")], tools=TOOLS, conversation_id="big")
        index = await stored_index(daemon, "big")
    # the call would be left out and its output sent alone: the turn does not fit, and is not sent
    assert caught.value.code == ErrorCode.CONTEXT_WINDOW_EXCEEDED and caught.value.details["call_ids"] == ["call_big"]
    assert len(stub.requests) == 1 and len(index) == 1


# -- bad input ----------------------------------------------------------------------------------------

async def refused(client: KsiClient, daemon: Daemon, data: dict[str, Any]) -> KsiError:
    """The request is refused at once and nothing stored changes."""
    before = await stored_snapshot(daemon.settings)
    with pytest.raises(KsiError) as caught:
        await client.request("completion:async", data)
    assert await stored_snapshot(daemon.settings) == before
    return caught.value


@pytest.mark.backends
async def test_bad_tool_turns_are_refused_and_nothing_is_written(stub_daemon: Daemon, stub: StubOpenAI) -> None:
    async with connected(stub_daemon) as client:
        await loop_step_one(client, stub)
        sent = len(stub.requests)
        unknown = await refused(client, stub_daemon, {"input": [output("call_zz", "x")], "conversation_id": "tools"})
        assert unknown.code == ErrorCode.VALIDATION_ERROR and unknown.details["call_ids"] == ["call_zz"]
        missing = await refused(client, stub_daemon, {"prompt": "anything else?", "conversation_id": "tools"})
        assert missing.code == ErrorCode.VALIDATION_ERROR and missing.details["call_ids"] == ["call_a"]
        assert "call_a" in missing.message
        twice = await refused(client, stub_daemon, {"input": [output("call_a", "1"), output("call_a", "2")],
                                                    "conversation_id": "tools"})
        assert twice.code == ErrorCode.VALIDATION_ERROR
        new = await refused(client, stub_daemon, {"input": [output("call_a", "1")]})
        assert new.code == ErrorCode.VALIDATION_ERROR
        created = await refused(client, stub_daemon, {"input": [output("call_a", "1")], "conversation_id": "fresh",
                                                      "create": True})
        assert created.code == ErrorCode.VALIDATION_ERROR
    assert len(stub.requests) == sent


@pytest.mark.parametrize(("tools", "extra", "field"), [
    ([{"type": "function", "name": "bad name"}], {}, "tools.0.name"),
    ([{"type": "function", "name": "x" * 65}], {}, "tools.0.name"),
    ([{"type": "function", "name": "f", "parameters": {"type": "string"}}], {}, "tools.0.parameters"),
    ([{"type": "function", "name": "f", "parameters": ["not", "a", "schema"]}], {}, "tools.0.parameters"),
    ([{"type": "function", "name": "f"}, {"type": "function", "function": {"name": "f"}}], {}, "tools"),
    ([WEATHER], {"tool_choice": {"type": "function", "name": "clock"}}, "tool_choice"),
    ([], {"tool_choice": "required"}, "tool_choice"),
    ([WEATHER], {"options": {"n": 3}}, "options.n"),
])
async def test_malformed_tools_and_several_answers_are_refused(
        stub_daemon: Daemon, stub: StubOpenAI, tools: list[dict[str, Any]], extra: dict[str, Any], field: str) -> None:
    async with connected(stub_daemon) as client:
        error = await refused(client, stub_daemon, {"prompt": "hi", "tools": tools, **extra})
    assert error.code == (ErrorCode.UNSUPPORTED_PARAMETER if field == "options.n" else ErrorCode.VALIDATION_ERROR)
    assert list(error.details["fields"]) == [field]
    assert stub.requests == []


async def test_tools_go_only_where_they_can_be_called(short_tmp: Path, stub: StubOpenAI) -> None:
    settings = stub_settings(stub, models={"openai/stub-plain": {"api_base": stub.api_base,
                                                                 "supports_function_calling": False}})
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        for target in ({"model": "openai/stub-plain"},  # a CLI model: test_cli_provider.py
                       {"consortium": {"members": ["openai/stub-model", "openai/stub-other"], "arbiter": "openai/stub-model"}}):
            error = await refused(client, daemon, {"prompt": "hi", "tools": [WEATHER], **target})
            assert error.code == ErrorCode.UNSUPPORTED_PARAMETER, target
            assert list(error.details["fields"]) == ["tools"]
        # a tool in options points at the field
        error = await refused(client, daemon, {"prompt": "hi", "options": {"tools": [CLOCK]}})
        assert error.code == ErrorCode.UNSUPPORTED_PARAMETER and "tools field" in error.message
        # an image part is refused by name until images are kept
        error = await refused(client, daemon, {"input": [{"role": "user", "content": [
            {"type": "input_text", "text": "see"}, {"type": "input_image", "image_url": "https://x.test/a.png"}]}]})
        assert error.code == ErrorCode.UNSUPPORTED_PARAMETER and list(error.details["fields"]) == ["input.0.content.1"]
        # a model nobody declared gets the tools, and its own refusal of them comes back
        await complete(client, prompt="hi", tools=[WEATHER], model="openai/stub-undeclared")
        assert stub.requests[-1]["tools"][0]["function"]["name"] == "weather"
        stub.enqueue(Reply(status=400, body=json.dumps({"error": {
            "message": "stub-undeclared does not support tools", "type": "invalid_request_error"}})))
        with pytest.raises(KsiError) as caught:
            await complete(client, prompt="hi", tools=[WEATHER], model="openai/stub-undeclared")
    assert caught.value.code == ErrorCode.PROVIDER_ERROR and "does not support tools" in caught.value.message
