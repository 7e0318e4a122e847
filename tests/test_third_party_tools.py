"""Tool loops of agent frameworks nobody here wrote, used as their own docs tell a user to, against
the OpenAI-compatible door of a real daemon (real litellm, the stub calling tools). They run in a
virtualenv of their own (tests/client_venvs.py): their SDKs need a newer `openai` than litellm allows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ksi_daemon.context import EventContext
from ksi_daemon.transports.http.openai.response_object import ksi_id
from tests.client_venvs import run_client
from tests.conftest import HttpDaemon
from tests.stub_openai import Reply, StubOpenAI
from tests.test_third_party_clients import client_env, clients_python

__all__ = ["clients_python"]  # the session fixture, shared with the plain-answer tests

AGENT_TOOLS = """
import asyncio, json, os
from openai import AsyncOpenAI
from agents import Agent, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool
from agents import set_tracing_disabled
set_tracing_disabled(True)
client = AsyncOpenAI(base_url=os.environ["KSI_BASE_URL"], api_key=os.environ["KSI_TOKEN"], max_retries=0)

@function_tool
def weather(city: str) -> str:
    \"\"\"The weather in a city.\"\"\"
    return f"12C in {city}"

@function_tool
def clock(city: str) -> str:
    \"\"\"The local time in a city.\"\"\"
    return f"09:30 in {city}"

kind = os.environ["MODEL_KIND"]
model_class = OpenAIResponsesModel if kind == "responses" else OpenAIChatCompletionsModel
agent = Agent(name="helper", instructions="Use the tools.", tools=[weather, clock],
              model=model_class(model="openai/stub-model", openai_client=client))
# the Responses model continues by previous_response_id, sending only what is new: the calls' outputs
chained = {"auto_previous_response_id": True} if kind == "responses" else {}
result = asyncio.run(Runner.run(agent, "Weather in Oslo and time in Lima?", **chained))
print(json.dumps({"final": result.final_output, "responses": [r.response_id for r in result.raw_responses]}))
"""

LANGCHAIN_TOOLS = """
import json, os
from langchain_core.messages import HumanMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

@tool
def weather(city: str) -> str:
    \"\"\"The weather in a city.\"\"\"
    return f"12C in {city}"

model = ChatOpenAI(model="openai/stub-model", base_url=os.environ["KSI_BASE_URL"], api_key=os.environ["KSI_TOKEN"],
                   max_retries=0).bind_tools([weather])
messages = [HumanMessage("Weather in Oslo?")]
asked = model.invoke(messages)
messages.append(asked)
for call in asked.tool_calls:
    messages.append(weather.invoke(call))  # a ToolMessage answering the call
final = model.invoke(messages)
print(json.dumps({"calls": [[c["id"], c["name"], c["args"]] for c in asked.tool_calls], "final": final.content}))
"""

LANGCHAIN_STRUCTURED = """
import json, os
from pydantic import BaseModel
from langchain_openai import ChatOpenAI

class Place(BaseModel):
    city: str
    country: str

model = ChatOpenAI(model="openai/stub-model", base_url=os.environ["KSI_BASE_URL"], api_key=os.environ["KSI_TOKEN"],
                   max_retries=0)
place = model.with_structured_output(Place).invoke("Where is the Eiffel tower?")
print(json.dumps(place.model_dump()))
"""


def tool_messages(stub: StubOpenAI, index: int = -1) -> list[tuple[str, str]]:
    return [(m["tool_call_id"], m["content"]) for m in stub.messages(index) if m["role"] == "tool"]


def calls_sent(stub: StubOpenAI, index: int = -1) -> list[tuple[str, str, dict[str, Any]]]:
    return [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for m in stub.messages(index) for c in m.get("tool_calls") or []]


async def conversations(http: HttpDaemon) -> list[dict[str, Any]]:
    listed = await http.daemon.router.request("conversation:list", {}, EventContext.root())
    return list(listed["conversations"])


async def run_agent(python: Path, http: HttpDaemon, stub: StubOpenAI, kind: str) -> dict[str, Any]:
    stub.enqueue(Reply(calls=[{"id": "call_w", "name": "weather", "arguments": {"city": "Oslo"}},
                              {"id": "call_c", "name": "clock", "arguments": {"city": "Lima"}}]),
                 "It is 12C in Oslo and 09:30 in Lima.")
    out: dict[str, Any] = await run_client(python, AGENT_TOOLS, {**client_env(http), "MODEL_KIND": kind})
    assert out["final"] == "It is 12C in Oslo and 09:30 in Lima."
    assert [tool["function"]["name"] for tool in stub.requests[0]["tools"]] == ["weather", "clock"]
    assert calls_sent(stub) == [("call_w", "weather", {"city": "Oslo"}), ("call_c", "clock", {"city": "Lima"})]
    assert tool_messages(stub) == [("call_w", "12C in Oslo"), ("call_c", "09:30 in Lima")]
    assert stub.messages()[0] == {"role": "system", "content": "Use the tools."}
    return out


async def test_an_openai_agents_tool_loop_over_responses_is_one_conversation(
        clients_python: Path, http_daemon: HttpDaemon, stub: StubOpenAI) -> None:
    out = await run_agent(clients_python, http_daemon, stub, "responses")
    [conversation] = await conversations(http_daemon)
    assert conversation["exchanges"] == 2
    first, second = out["responses"]
    assert first.startswith("resp_") and second.startswith("resp_")  # the door's ids, KSI's after the prefix
    shown = await http_daemon.daemon.router.request("response:show", {"response_id": ksi_id(second)},
                                                    EventContext.root())
    assert shown["previous_response_id"] == ksi_id(first)


async def test_an_openai_agents_tool_loop_over_chat_completions(
        clients_python: Path, http_daemon: HttpDaemon, stub: StubOpenAI) -> None:
    await run_agent(clients_python, http_daemon, stub, "chat")
    # the second call resent the whole history: imported with its calls (a history that finds its
    # conversation again is another change), then the calls' outputs answered as the new input
    newest = max(await conversations(http_daemon), key=lambda c: c["exchanges"])
    assert newest["exchanges"] == 2


async def test_langchain_bind_tools_round_trip(
        clients_python: Path, http_daemon: HttpDaemon, stub: StubOpenAI) -> None:
    stub.enqueue(Reply(calls=[{"id": "call_w", "name": "weather", "arguments": {"city": "Oslo"}}]),
                 "12C in Oslo, then.")
    out = await run_client(clients_python, LANGCHAIN_TOOLS, client_env(http_daemon))
    assert out == {"calls": [["call_w", "weather", {"city": "Oslo"}]], "final": "12C in Oslo, then."}
    assert [tool["function"]["name"] for tool in stub.requests[0]["tools"]] == ["weather"]
    assert calls_sent(stub) == [("call_w", "weather", {"city": "Oslo"})]
    assert tool_messages(stub) == [("call_w", "12C in Oslo")]


async def test_langchain_structured_output_follows_the_schema_it_sent(
        clients_python: Path, http_daemon: HttpDaemon, stub: StubOpenAI) -> None:
    stub.enqueue('{"city": "Paris", "country": "France"}')
    out = await run_client(clients_python, LANGCHAIN_STRUCTURED, client_env(http_daemon))
    assert out == {"city": "Paris", "country": "France"}
    sent = stub.requests[-1]["response_format"]
    assert sent["type"] == "json_schema" and sent["json_schema"]["name"] == "Place"
    assert set(sent["json_schema"]["schema"]["properties"]) == {"city", "country"}
