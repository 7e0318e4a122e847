"""openai-agents' `OpenAIConversationsSession` with a function tool, used as the SDK's docs tell a
user to, against a real daemon, real litellm and the stub: three runs, each calling the tool once
and answering. The SDK adds each run's items (its user message, the call, the call's output, the
answer) to its conversation, which the run's responses already stored there: the session keeps
ONE KSI conversation holding every turn once, and each later run's model is sent the earlier
calls and outputs (read from the stub's log). Runs in the client virtualenv (tests/client_venvs.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ksi_daemon.context import EventContext
from tests.client_venvs import run_client
from tests.conftest import running_http_daemon, stub_settings
from tests.stub_openai import Reply, StubOpenAI
from tests.test_third_party_clients import client_env, clients_python

__all__ = ["clients_python"]
pytestmark = pytest.mark.backends

CITIES = ("Oslo", "Bergen", "Tromso")

TOOL_RUNS = """
import asyncio, json, os
from openai import AsyncOpenAI
from agents import (Agent, OpenAIConversationsSession, OpenAIResponsesModel, Runner, function_tool,
                    set_default_openai_client, set_tracing_disabled)
set_tracing_disabled(True)
client = AsyncOpenAI(base_url=os.environ["KSI_BASE_URL"], api_key=os.environ["KSI_TOKEN"], max_retries=0)
set_default_openai_client(client, use_for_tracing=False)

@function_tool
def weather(city: str) -> str:
    \"\"\"The weather in a city.\"\"\"
    return f"sunny in {city}"

agent = Agent(name="Assistant", instructions="Use the tool.", tools=[weather],
              model=OpenAIResponsesModel(model="openai/stub-model", openai_client=client))

async def main():
    session = OpenAIConversationsSession()
    finals = []
    for city in json.loads(os.environ["CITIES"]):
        result = await Runner.run(agent, f"Weather in {city}?", session=session)
        finals.append(result.final_output)
    held = await session.get_items()
    print(json.dumps({"finals": finals, "conversation": session.session_id,
                      "held": [item.get("role") or item.get("type") for item in held]}))

asyncio.run(main())
"""


def replies() -> list[Reply | str]:
    script: list[Reply | str] = []
    for n, city in enumerate(CITIES):
        script += [Reply(calls=[{"id": f"call_{n}", "name": "weather", "arguments": {"city": city}}]),
                   f"It is sunny in {city}."]
    return script


def replayed(messages: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    shown: list[tuple[str, Any]] = []
    for message in messages:
        if message.get("tool_calls"):
            shown.append(("call", message["tool_calls"][0]["id"]))
        elif message["role"] == "tool":
            shown.append(("output", message["tool_call_id"]))
        else:
            shown.append((message["role"], message["content"]))
    return shown


async def test_a_conversations_session_with_a_function_tool_over_three_runs_is_one_conversation(
        clients_python: Path, short_tmp: Path, stub: StubOpenAI, backend: dict[str, Any]) -> None:
    async with running_http_daemon(short_tmp, **stub_settings(stub), **backend) as http:
        stub.enqueue(*replies())
        out = await run_client(clients_python, TOOL_RUNS, {**client_env(http), "CITIES": json.dumps(CITIES)})
        assert out["finals"] == [f"It is sunny in {city}." for city in CITIES]
        assert out["held"] == ["user", "function_call", "function_call_output", "assistant"] * 3
        # the last run's model was sent every earlier turn, its calls and outputs replayed once, in order
        expected: list[tuple[str, Any]] = [("system", "Use the tool.")]
        for n, city in enumerate(CITIES):
            expected += [("user", f"Weather in {city}?"), ("call", f"call_{n}"), ("output", f"call_{n}")]
            if n < len(CITIES) - 1:
                expected.append(("assistant", f"It is sunny in {city}."))
        assert replayed(stub.messages()) == expected
        listed = await http.daemon.router.request("conversation:list", {}, EventContext.root())
        assert [c["conversation_id"] for c in listed["conversations"]] == [out["conversation"]]
        assert listed["conversations"][0]["exchanges"] == 6  # a call and its answer per run
        shown = await http.daemon.router.request("conversation:show", {"conversation_id": out["conversation"]},
                                                 EventContext.root())
        assert shown["conversation"]["pending_input"] == []
