"""Abandoning an open tool call (conversation:abandon_calls): a call whose arguments are too big
for the model's window can be neither answered nor passed; once abandoned, the next turn is a plain
one, the model is sent a stand-in for the arguments, and the whole call stays stored. Through the
socket, real litellm and the local stub, on both backends; bad requests refused with their code
before anything is written."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from ksi_common.client import KsiClient
from ksi_common.errors import ErrorCode, KsiError
from ksi_common.items import ABANDONED_ARGUMENTS, ABANDONED_OUTPUT
from ksi_daemon.daemon import Daemon
from tests.conftest import complete, connected, running_daemon, stub_settings
from tests.stored import stored_index, stored_snapshot
from tests.stub_openai import Reply, StubOpenAI

pytestmark = pytest.mark.backends

WEATHER = {"type": "function", "name": "weather", "description": "today's weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
SMALL = "openai/stub-small"
BIG_TEXT = "the quick brown fox jumps over the lazy dog "
BIG = {"notes": BIG_TEXT * 60}  # about 660 tokens: more than the window leaves for history


def small_window(stub: StubOpenAI, backend: dict[str, Any]) -> dict[str, Any]:
    return {**stub_settings(stub, models={SMALL: {"api_base": stub.api_base, "context_window": 700,
                                                  "output_reserve": 100}},
                            calibration=False, summariser="off", default_model=SMALL), **backend}


async def big_call(client: KsiClient, stub: StubOpenAI, conversation_id: str = "big",
                   calls: tuple[str, ...] = ("call_big",)) -> dict[str, Any]:
    stub.enqueue(Reply(calls=[{"id": call_id, "name": "weather", "arguments": BIG} for call_id in calls]))
    return await complete(client, prompt="Weather?", tools=[WEATHER], conversation_id=conversation_id, create=True)


async def refused(client: KsiClient, daemon: Daemon, event: str, data: dict[str, Any]) -> KsiError:
    """The request is refused at once and nothing stored changes."""
    before = await stored_snapshot(daemon.settings)
    with pytest.raises(KsiError) as caught:
        await client.request(event, data)
    assert await stored_snapshot(daemon.settings) == before
    return caught.value


async def test_an_abandoned_call_lets_the_next_turn_be_answered_with_a_stand_in(
        short_tmp: Path, stub: StubOpenAI, backend: dict[str, Any]) -> None:
    async with running_daemon(short_tmp, **small_window(stub, backend)) as daemon, connected(daemon) as client:
        await big_call(client, stub)
        # before: the call can be neither answered (it does not fit with its output) nor passed
        with pytest.raises(KsiError) as answer:
            await complete(client, input=[{"type": "function_call_output", "call_id": "call_big", "output": "12C"}],
                           conversation_id="big")
        assert len(await stored_index(daemon, "big")) == 1  # the failed turn is in no history
        plain = await refused(client, daemon, "completion:async", {"prompt": "Never mind.", "conversation_id": "big"})
        abandoned = await client.request("conversation:abandon_calls", {"conversation_id": "big"})
        stub.enqueue(Reply(text="Fine, no weather then."))
        after = await complete(client, prompt="Never mind, tell me a joke.", conversation_id="big")
        stub.enqueue(Reply(text="Another one."))
        later = await complete(client, prompt="And another?", conversation_id="big")
        shown = await client.request("conversation:show", {"conversation_id": "big"})
        rebuilt = await client.request("conversation:sent", {"conversation_id": "big", "n": 2})
    assert answer.value.code == ErrorCode.CONTEXT_WINDOW_EXCEEDED
    assert plain.code == ErrorCode.VALIDATION_ERROR and plain.details["call_ids"] == ["call_big"]
    assert abandoned["abandoned"] == ["call_big"] and abandoned["pending"][0]["item"]["abandoned"] is True
    assert after["content"] == "Fine, no weather then." and later["content"] == "Another one."
    sent = stub.requests[-2]["messages"]
    calls = [call for message in sent for call in message.get("tool_calls") or []]
    assert [call["function"]["arguments"] for call in calls] == [ABANDONED_ARGUMENTS]
    assert {"role": "tool", "tool_call_id": "call_big", "content": ABANDONED_OUTPUT} in sent
    assert sent[-1] == {"role": "user", "content": "Never mind, tell me a joke."}
    assert BIG_TEXT not in json.dumps(sent) and BIG_TEXT not in json.dumps(stub.requests[-1]["messages"])
    # the turn after still shows the call (its stand-in), the abandoned output and the answer to it
    assert stub.requests[-1]["messages"][:len(sent) - 1] == sent[:-1]
    assert later["history"]["exchanges_sent"] == 2
    # stored: the call whole, and the abandoned output as the next exchange's first input
    first, second, _third = shown["exchanges"]
    assert json.loads(first["output"][0]["arguments"]) == BIG
    assert second["input"][0] == {"type": "function_call_output", "call_id": "call_big",
                                  "output": ABANDONED_OUTPUT, "abandoned": True}
    # conversation:sent rebuilds what went out: the stand-in, not the stored arguments
    rebuilt_calls = [call for message in rebuilt["messages"] for call in message.get("tool_calls") or []]
    assert [call["arguments"] for call in rebuilt_calls] == [ABANDONED_ARGUMENTS]


async def test_one_of_two_calls_abandoned_the_other_is_still_answered(stub_daemon: Daemon, stub: StubOpenAI) -> None:
    async with connected(stub_daemon) as client:
        await big_call(client, stub, "two", ("call_a", "call_b"))
        await client.request("conversation:abandon_calls", {"conversation_id": "two", "call_ids": ["call_a"]})
        missing = await refused(client, stub_daemon, "completion:async", {"prompt": "hm", "conversation_id": "two"})
        stub.enqueue(Reply(text="Bergen is 9C."))
        result = await complete(client, input=[{"type": "function_call_output", "call_id": "call_b", "output": "9C"}],
                                conversation_id="two")
    assert missing.code == ErrorCode.VALIDATION_ERROR and missing.details["call_ids"] == ["call_b"]
    assert result["content"] == "Bergen is 9C."
    sent = stub.requests[-1]["messages"]
    arguments = {call["id"]: call["function"]["arguments"] for m in sent for call in m.get("tool_calls") or []}
    assert arguments["call_a"] == ABANDONED_ARGUMENTS and json.loads(arguments["call_b"]) == BIG
    assert [m["content"] for m in sent if m["role"] == "tool"] == [ABANDONED_OUTPUT, "9C"]


async def test_bad_abandon_requests_are_refused_and_nothing_is_written(stub_daemon: Daemon, stub: StubOpenAI) -> None:
    event = "conversation:abandon_calls"
    async with connected(stub_daemon) as client:
        unknown = await refused(client, stub_daemon, event, {"conversation_id": "nowhere"})
        await big_call(client, stub)
        wrong = await refused(client, stub_daemon, event, {"conversation_id": "big", "call_ids": ["call_zz"]})
        empty = await refused(client, stub_daemon, event, {"conversation_id": "big", "call_ids": []})
        await client.request(event, {"conversation_id": "big", "call_ids": ["call_big"]})
        again = await refused(client, stub_daemon, event, {"conversation_id": "big"})
        answered = await refused(client, stub_daemon, "completion:async", {
            "input": [{"type": "function_call_output", "call_id": "call_big", "output": "12C"}],
            "conversation_id": "big"})
        await big_call(client, stub, "shelved")
        await client.request("conversation:archive", {"conversation_id": "shelved"})
        archived = await refused(client, stub_daemon, event, {"conversation_id": "shelved"})
        stub.enqueue(Reply(text="No call here."))
        await complete(client, prompt="Hello", conversation_id="plain", create=True)
        none_open = await refused(client, stub_daemon, event, {"conversation_id": "plain"})
        # a turn in flight: the conversation's newest exchange is about to change
        gate = asyncio.Event()
        stub.enqueue(Reply(text="slow", delay=0.0, gate=gate))
        ack = await client.request("completion:async", {"prompt": "Slowly", "conversation_id": "plain",
                                                        "stream": True})
        busy = await refused(client, stub_daemon, event, {"conversation_id": "plain"})
        gate.set()
        await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 30})
    assert unknown.code == ErrorCode.CONVERSATION_NOT_FOUND
    assert wrong.code == ErrorCode.CALL_NOT_OPEN and wrong.details["call_ids"] == ["call_zz"]
    assert wrong.details["open_call_ids"] == ["call_big"]
    assert empty.code == ErrorCode.VALIDATION_ERROR
    assert again.code == ErrorCode.CALL_NOT_OPEN and again.details["open_call_ids"] == []
    assert answered.code == ErrorCode.VALIDATION_ERROR and answered.details["call_ids"] == ["call_big"]
    assert archived.code == ErrorCode.CONVERSATION_ARCHIVED
    assert none_open.code == ErrorCode.CALL_NOT_OPEN
    assert busy.code == ErrorCode.TURN_IN_PROGRESS


@pytest.mark.parametrize("fmt", ["json", "jsonl"])
async def test_export_import_export_keeps_the_abandoned_output(stub_daemon: Daemon, stub: StubOpenAI,
                                                               fmt: str) -> None:
    async with connected(stub_daemon) as client:
        await big_call(client, stub, "first")
        await client.request("conversation:abandon_calls", {"conversation_id": "first"})
        stub.enqueue(Reply(text="Fine."))
        await complete(client, prompt="Skip it.", conversation_id="first")
        exported = (await client.request("conversation:export", {"conversation_id": "first", "format": fmt}))["content"]
        await client.request("conversation:import", {"data": exported, "new_id": "second"})
        again = (await client.request("conversation:export", {"conversation_id": "second", "format": fmt}))["content"]
        shown = await client.request("conversation:show", {"conversation_id": "second"})

    def exchanges(content: str) -> list[dict[str, Any]]:
        found = orjson.loads(content)["exchanges"] if fmt == "json" else [
            orjson.loads(line) for line in content.splitlines()][1:]
        return [{k: v for k, v in x.items() if k not in ("response_id", "conversation_id")} for x in found]

    assert exchanges(again) == exchanges(exported)
    assert shown["exchanges"][1]["input"][0]["abandoned"] is True


async def ksi(*args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "ksi_cli", *args, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await process.communicate()
    return process.returncode or 0, out.decode(), err.decode()


async def test_the_cli_abandons_named_calls_then_the_rest(stub_daemon: Daemon, stub: StubOpenAI) -> None:
    where = ["--socket", str(stub_daemon.settings.socket), "--var-dir", str(stub_daemon.settings.var_dir)]
    async with connected(stub_daemon) as client:
        await big_call(client, stub, "cli", ("call_a", "call_b", "call_c"))
        named = await ksi("conversation", "abandon-calls", "cli", "--call", "call_a", "--call", "call_b",
                          *where, "--json")
        rest = await ksi("conversation", "abandon-calls", "cli", *where)
        before = await stored_snapshot(stub_daemon.settings)
        refused_again = await ksi("conversation", "abandon-calls", "cli", "--call", "call_a", *where, "--json")
        assert await stored_snapshot(stub_daemon.settings) == before
        stub.enqueue(Reply(text="Moving on."))
        answered = await complete(client, prompt="Moving on.", conversation_id="cli")
    assert named[0] == 0 and json.loads(named[1])["abandoned"] == ["call_a", "call_b"]
    assert rest[0] == 0 and json.loads(rest[1])["abandoned"] == ["call_c"]
    code, out, err = refused_again
    assert code != 0 and json.loads(out or err)["error"]["code"] == "call_not_open"
    assert answered["content"] == "Moving on."
    assert [m["content"] for m in stub.requests[-1]["messages"] if m["role"] == "tool"] == [ABANDONED_OUTPUT] * 3


async def test_an_export_before_the_next_turn_leaves_the_call_open_in_the_copy(stub_daemon: Daemon,
                                                                             stub: StubOpenAI) -> None:
    async with connected(stub_daemon) as client:
        await big_call(client, stub, "waiting")
        await client.request("conversation:abandon_calls", {"conversation_id": "waiting"})
        exported = (await client.request("conversation:export", {"conversation_id": "waiting", "format": "json"}))
        await client.request("conversation:import", {"data": exported["content"], "new_id": "copy"})
        again = await client.request("conversation:export", {"conversation_id": "copy", "format": "json"})
        abandoned = await client.request("conversation:abandon_calls", {"conversation_id": "copy"})
    # pending input is not exported: the copy waits for the call, and it can be abandoned there too
    drop = ("response_id", "conversation_id")
    assert [{k: v for k, v in x.items() if k not in drop} for x in orjson.loads(again["content"])["exchanges"]] == [
        {k: v for k, v in x.items() if k not in drop} for x in orjson.loads(exported["content"])["exchanges"]]
    assert abandoned["abandoned"] == ["call_big"]


async def test_a_fork_abandons_its_parents_call_and_keeps_it_in_later_turns(
        short_tmp: Path, stub: StubOpenAI, backend: dict[str, Any]) -> None:
    async with running_daemon(short_tmp, **small_window(stub, backend)) as daemon, connected(daemon) as client:
        await big_call(client, stub)
        await client.request("conversation:fork", {"conversation_id": "big", "at": 1, "new_id": "branch"})
        abandoned = await client.request("conversation:abandon_calls", {"conversation_id": "branch"})
        for text in ("First in the branch.", "Second in the branch."):
            stub.enqueue(Reply(text=text))
            await complete(client, prompt=f"Say: {text}", conversation_id="branch")
        plain = await refused(client, daemon, "completion:async", {"prompt": "Never mind.", "conversation_id": "big"})
    assert abandoned["abandoned"] == ["call_big"]
    assert plain.code == ErrorCode.VALIDATION_ERROR  # the parent still waits for its call
    for body in stub.requests[-2:]:
        calls = [call for message in body["messages"] for call in message.get("tool_calls") or []]
        assert [call["function"]["arguments"] for call in calls] == [ABANDONED_ARGUMENTS]
        assert BIG_TEXT not in json.dumps(body["messages"])
    assert stub.requests[-1]["messages"][0] == {"role": "user", "content": "Weather?"}
