"""JS clients of the Responses API through the OpenAI door, used as their docs tell a user to, as a
node subprocess with pinned npm packages (tests/client_node.py), against a real daemon, real
litellm and the stub. Each runs three turns, each a multi-step tool turn (the model calls a
function tool, the SDK runs it and sends its output back, the model answers):

- the Vercel AI SDK's `openai.responses(...)` with `store` on (its default), resending the whole
  conversation each turn: the answers it was given come back as `item_reference` items;
- the same SDK with `previousResponseId` (the previous turn's response) and only the new message:
  each step resends its own call and the call's output after that same point;
- the Agents SDK's `OpenAIConversationsSession`: its conversation made empty, each run's responses
  naming none (the session's items and the new message as input), the run's items added after it.

Each ends as ONE KSI conversation, every call and output replayed to the provider in later turns
(read from the stub's log)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest

from ksi_daemon.context import EventContext
from tests.client_node import client_node_modules
from tests.conftest import HttpDaemon, running_http_daemon, stub_settings
from tests.stub_openai import Reply, StubOpenAI

pytestmark = pytest.mark.backends

# the JS clients of the Responses and Conversations APIs, in one cached node_modules
JS_CLIENTS = ("@openai/agents@0.20.0", "ai@7.0.173", "@ai-sdk/openai@4.0.118")
CITIES = ("Oslo", "Bergen", "Tromso")

VERCEL = """
import { createOpenAI } from "@ai-sdk/openai";
import { generateText, tool, jsonSchema, stepCountIs } from "ai";
const openai = createOpenAI({ baseURL: process.env.KSI_BASE_URL, apiKey: process.env.KSI_TOKEN });
const weather = tool({
  description: "the weather in a city",
  inputSchema: jsonSchema({ type: "object", properties: { city: { type: "string" } }, required: ["city"] }),
  execute: async ({ city }) => `sunny in ${city}`,
});
const byPrevious = process.env.MODE === "previous";
const finals = [];
let messages = [];
let previous;
for (const city of JSON.parse(process.env.CITIES)) {
  const question = { role: "user", content: `Weather in ${city}?` };
  const result = await generateText({
    model: openai.responses("openai/stub-model"), tools: { weather }, stopWhen: stepCountIs(5),
    messages: byPrevious ? [question] : [...messages, question],
    providerOptions: byPrevious && previous ? { openai: { previousResponseId: previous } } : undefined,
  });
  finals.push(result.text);
  messages = [...messages, question, ...result.response.messages];
  previous = result.providerMetadata.openai.responseId;
}
console.log(JSON.stringify({ finals }));
"""

AGENTS = """
import OpenAI from "openai";
import { Agent, run, tool, setDefaultOpenAIClient, setOpenAIAPI, setTracingDisabled,
         OpenAIConversationsSession } from "@openai/agents";
const client = new OpenAI({ baseURL: process.env.KSI_BASE_URL, apiKey: process.env.KSI_TOKEN });
setDefaultOpenAIClient(client);
setOpenAIAPI("responses");
setTracingDisabled(true);
const weather = tool({
  name: "weather", description: "the weather in a city",
  parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"],
                additionalProperties: false },
  strict: true, execute: async ({ city }) => `sunny in ${city}`,
});
const agent = new Agent({ name: "forecaster", instructions: "Answer briefly.", model: "openai/stub-model",
                          tools: [weather] });
const session = new OpenAIConversationsSession({ client });
const finals = [];
for (const city of JSON.parse(process.env.CITIES)) {
  const result = await run(agent, `Weather in ${city}?`, { session });
  finals.push(result.finalOutput);
}
console.log(JSON.stringify({ finals, session: await session.getSessionId() }));
"""


@pytest.fixture(scope="session")
def js_clients() -> Path:
    return client_node_modules(JS_CLIENTS)


async def run_node(home: Path, script: str, env: dict[str, str], timeout: float = 120.0) -> Any:
    """Run an ES module with `home`'s node_modules; its last stdout line is JSON, returned."""
    process = await asyncio.create_subprocess_exec(
        "node", "--input-type=module", "-e", script, cwd=home, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env={**os.environ, **env})
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    if process.returncode != 0:
        raise AssertionError(f"node client failed ({process.returncode}):\n{err.decode()[-4000:]}")
    return json.loads([line for line in out.decode().splitlines() if line.strip()][-1])


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
        elif message["role"] != "system":
            shown.append((message["role"], message["content"]))
    return shown


def every_turn() -> list[tuple[str, Any]]:
    """What the last step's model is sent: every turn, its call and output, in order."""
    expected: list[tuple[str, Any]] = []
    for n, city in enumerate(CITIES):
        expected += [("user", f"Weather in {city}?"), ("call", f"call_{n}"), ("output", f"call_{n}")]
        if n < len(CITIES) - 1:
            expected.append(("assistant", f"It is sunny in {city}."))
    return expected


async def one_conversation(http: HttpDaemon) -> dict[str, Any]:
    listed = await http.daemon.router.request("conversation:list", {}, EventContext.root())
    [conversation] = listed["conversations"]
    assert conversation["exchanges"] == 6  # a call and its answer per turn, each stored once
    return dict(conversation)


@pytest.mark.parametrize("mode", ["store", "previous"])
async def test_the_vercel_ai_sdk_over_three_multi_step_tool_turns_is_one_conversation(
        js_clients: Path, short_tmp: Path, stub: StubOpenAI, backend: dict[str, Any], mode: str) -> None:
    async with running_http_daemon(short_tmp, **stub_settings(stub), **backend) as http:
        stub.enqueue(*replies())
        out = await run_node(js_clients, VERCEL, {"KSI_BASE_URL": f"{http.base_url}/v1", "KSI_TOKEN": http.token,
                                                  "MODE": mode, "CITIES": json.dumps(CITIES)})
        assert out["finals"] == [f"It is sunny in {city}." for city in CITIES]
        assert replayed(stub.messages()) == every_turn()
        await one_conversation(http)


async def test_the_agents_sdk_conversations_session_over_three_tool_runs_is_one_conversation(
        js_clients: Path, short_tmp: Path, stub: StubOpenAI, backend: dict[str, Any]) -> None:
    async with running_http_daemon(short_tmp, **stub_settings(stub), **backend) as http:
        stub.enqueue(*replies())
        out = await run_node(js_clients, AGENTS, {"KSI_BASE_URL": f"{http.base_url}/v1", "KSI_TOKEN": http.token,
                                                  "CITIES": json.dumps(CITIES)})
        assert out["finals"] == [f"It is sunny in {city}." for city in CITIES]
        assert replayed(stub.messages()) == every_turn()
        conversation = await one_conversation(http)
        assert conversation["conversation_id"] == out["session"]  # the session's own, holding its first run
