"""A client-held history with tool calls: the request's new input is checked against the
history's newest exchange before anything is written for the history (an import, a fork, the
turns appended to it), so a refused request leaves no conversation behind however often it is
retried; a call's name in the history follows the rule of a tool's name. On both backends."""

from __future__ import annotations

from typing import Any

import pytest

from ksi_common.errors import ErrorCode, KsiError
from ksi_daemon.daemon import Daemon
from tests.conftest import complete, connected
from tests.stored import stored_snapshot

pytestmark = pytest.mark.backends

CALLED = [{"role": "user", "content": "What is the weather in Oslo?"},
          {"type": "function_call", "call_id": "call-1", "name": "weather", "arguments": '{"city": "Oslo"}'}]
ANSWERED = [*CALLED, {"type": "function_call_output", "call_id": "call-1", "output": "12C"},
            {"role": "assistant", "content": "It is 12C in Oslo."}]
PLAIN = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"}]


def output(call_id: str) -> list[dict[str, Any]]:
    return [{"type": "function_call_output", "call_id": call_id, "output": "12C"}]


async def test_new_input_refused_by_the_history_writes_nothing_on_any_retry(stub_daemon: Daemon) -> None:
    async with connected(stub_daemon) as client:
        # a stored conversation the histories below share a first exchange with (a fork's path)
        first = await complete(client, prompt="hello")
        stored_plain = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": first["content"]}]
        cases: list[tuple[str, list[dict[str, Any]], dict[str, Any], str]] = [
            ("an output for a call never made", PLAIN, {"input": output("call-9")}, "no such call is open"),
            ("an output for a call already answered", ANSWERED, {"input": output("call-1")}, "no such call is open"),
            ("an output for another call than the open one", CALLED, {"input": output("call-2")},
             "no such call is open"),
            ("a plain turn after an unanswered call", CALLED, {"prompt": "never mind"}, "outputs are missing"),
            ("a plain turn after a call, a stored exchange shared", [*stored_plain, *CALLED],
             {"prompt": "never mind"}, "outputs are missing"),
        ]
        before = await stored_snapshot(stub_daemon.settings)
        for name, history, new_input, why in cases:
            for _retry in range(3):
                with pytest.raises(KsiError) as refused:
                    await client.request("completion:async", {**new_input, "history": history})
                assert refused.value.code == ErrorCode.VALIDATION_ERROR, name
                assert why in refused.value.message, name
                assert await stored_snapshot(stub_daemon.settings) == before, name


async def test_an_output_for_the_histories_open_call_is_taken(stub_daemon: Daemon) -> None:
    async with connected(stub_daemon) as client:
        result = await complete(client, input=output("call-1"), history=CALLED)
        assert result["exchange"] == 2
        shown = await client.request("conversation:show", {"conversation_id": result["conversation_id"]})
        assert shown["exchanges"][1]["inputs"][0]["type"] == "function_call_output"


@pytest.mark.parametrize("name", ["get weather", "", "x" * 65, "weather()", "météo"])
async def test_a_call_name_in_the_history_follows_the_tool_name_rule(stub_daemon: Daemon, name: str) -> None:
    history = [CALLED[0], {**CALLED[1], "name": name}]
    async with connected(stub_daemon) as client:
        before = await stored_snapshot(stub_daemon.settings)
        with pytest.raises(KsiError) as refused:
            await client.request("completion:async", {"input": output("call-1"), "history": history})
        assert refused.value.code == ErrorCode.VALIDATION_ERROR
        assert "history.1.name" in refused.value.details.get("fields", {}), refused.value.details
        assert await stored_snapshot(stub_daemon.settings) == before
