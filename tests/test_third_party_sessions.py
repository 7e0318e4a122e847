"""openai-agents' sessions and handoffs through the OpenAI door, used as the SDK's docs tell a
user to (the door's client set as the default client), against a real daemon, real litellm and
the stub: three runs over a `SQLiteSession` (the SDK resends the whole history each run), three
over an `OpenAIConversationsSession` (the SDK keeps the history in a Conversations API
conversation and adds each turn's items to it), and a triage agent handing off to a second one.
Each ends as ONE KSI conversation holding every turn in order. They run in a virtualenv of their
own (tests/client_venvs.py): their SDK needs a newer `openai` than litellm allows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ksi_common.items import input_items, output_items
from ksi_daemon.context import EventContext
from tests.client_venvs import run_client
from tests.conftest import HttpDaemon
from tests.stored import stored_index, stored_response
from tests.stub_openai import Reply, StubOpenAI
from tests.test_third_party_clients import client_env, clients_python

__all__ = ["clients_python"]  # the session fixture, shared with the other third-party tests

QUESTIONS = ("What city is the Golden Gate Bridge in?", "What state is it in?", "How many people live there?")
ANSWERS = ("San Francisco.", "California.", "About 800,000.")

SESSION_RUNS = """
import asyncio, json, os
from openai import AsyncOpenAI
from agents import (Agent, OpenAIConversationsSession, OpenAIResponsesModel, Runner, SQLiteSession,
                    set_default_openai_client, set_tracing_disabled)
set_tracing_disabled(True)
client = AsyncOpenAI(base_url=os.environ["KSI_BASE_URL"], api_key=os.environ["KSI_TOKEN"], max_retries=0)
set_default_openai_client(client, use_for_tracing=False)
agent = Agent(name="Assistant", instructions="Reply very concisely.",
              model=OpenAIResponsesModel(model="openai/stub-model", openai_client=client))

async def main():
    kind = os.environ["SESSION_KIND"]
    session = SQLiteSession("conversation_123") if kind == "sqlite" else OpenAIConversationsSession()
    finals = []
    for question in json.loads(os.environ["QUESTIONS"]):
        result = await Runner.run(agent, question, session=session)
        finals.append(result.final_output)
    held = await session.get_items()
    out = {"finals": finals, "held": [item.get("role") or item.get("type") for item in held]}
    if kind == "conversations":
        out["conversation"] = session.session_id
    print(json.dumps(out))

asyncio.run(main())
"""

HANDOFF = """
import asyncio, json, os
from openai import AsyncOpenAI
from agents import Agent, OpenAIResponsesModel, Runner, set_default_openai_client, set_tracing_disabled
set_tracing_disabled(True)
client = AsyncOpenAI(base_url=os.environ["KSI_BASE_URL"], api_key=os.environ["KSI_TOKEN"], max_retries=0)
set_default_openai_client(client, use_for_tracing=False)
model = OpenAIResponsesModel(model="openai/stub-model", openai_client=client)
billing = Agent(name="Billing agent", instructions="You answer billing questions.", model=model)
triage = Agent(name="Triage agent", instructions="Hand billing questions to the billing agent.",
               handoffs=[billing], model=model)
result = asyncio.run(Runner.run(triage, "I was charged twice this month."))
print(json.dumps({"final": result.final_output, "last_agent": result.last_agent.name}))
"""


async def conversations(http: HttpDaemon) -> list[dict[str, Any]]:
    listed = await http.daemon.router.request("conversation:list", {}, EventContext.root())
    return list(listed["conversations"])


async def exchanges(http: HttpDaemon, conversation_id: str) -> list[tuple[list[Any], list[Any]]]:
    """Each stored exchange of the conversation as (input items, output items)."""
    found = []
    for entry in await stored_index(http.daemon, conversation_id):
        record = await stored_response(http.daemon, entry["response_id"])
        assert record is not None
        found.append((input_items(record[:-1]), output_items(record[-1])))
    return found


def texts(items: list[Any]) -> list[tuple[str, str]]:
    return [(item["role"], item["content"]) for item in items if item["type"] == "message"]


async def run_sessions(python: Path, http: HttpDaemon, stub: StubOpenAI, kind: str) -> dict[str, Any]:
    stub.enqueue(*ANSWERS)
    out: dict[str, Any] = await run_client(python, SESSION_RUNS, {
        **client_env(http), "SESSION_KIND": kind, "QUESTIONS": json.dumps(QUESTIONS)})
    assert out["finals"] == list(ANSWERS)
    assert out["held"] == ["user", "assistant"] * 3  # what the SDK's session holds
    # the third run's model saw the whole conversation, in order
    assert [(m["role"], m["content"]) for m in stub.messages()] == [
        ("system", "Reply very concisely."), ("user", QUESTIONS[0]), ("assistant", ANSWERS[0]),
        ("user", QUESTIONS[1]), ("assistant", ANSWERS[1]), ("user", QUESTIONS[2])]
    return out


async def holds_every_turn(http: HttpDaemon, conversation_id: str) -> None:
    stored = await exchanges(http, conversation_id)
    assert [(texts(inputs), texts(outputs)) for inputs, outputs in stored] == [
        ([("user", question)], [("assistant", answer)]) for question, answer in zip(QUESTIONS, ANSWERS, strict=True)]


async def test_an_sqlite_session_over_three_runs_is_one_conversation(
        clients_python: Path, http_daemon: HttpDaemon, stub: StubOpenAI) -> None:
    await run_sessions(clients_python, http_daemon, stub, "sqlite")
    [conversation] = await conversations(http_daemon)
    await holds_every_turn(http_daemon, conversation["conversation_id"])


async def test_an_openai_conversations_session_over_three_runs_is_one_conversation(
        clients_python: Path, http_daemon: HttpDaemon, stub: StubOpenAI) -> None:
    out = await run_sessions(clients_python, http_daemon, stub, "conversations")
    # the SDK adds each user item to its conversation, asks /v1/responses with the whole history
    # and no conversation, then adds the answer: the response continues the conversation whose
    # exchanges and pending input that history and input are, and the answer added is the one it
    # stored, so the session's conversation is the only one, holding every turn once, in order
    [conversation] = await conversations(http_daemon)
    assert conversation["conversation_id"] == out["conversation"]
    await holds_every_turn(http_daemon, out["conversation"])
    shown = await http_daemon.daemon.router.request("conversation:show", {"conversation_id": out["conversation"]},
                                                    EventContext.root())
    assert shown["conversation"]["pending_input"] == []


async def test_a_handoff_is_one_conversation_holding_the_handoff_call_and_its_output(
        clients_python: Path, http_daemon: HttpDaemon, stub: StubOpenAI) -> None:
    stub.enqueue(Reply(calls=[{"id": "call_handoff", "name": "transfer_to_billing_agent", "arguments": {}}]),
                 "A refund of the second charge is on its way.")
    out = await run_client(clients_python, HANDOFF, client_env(http_daemon))
    assert out == {"final": "A refund of the second charge is on its way.", "last_agent": "Billing agent"}
    assert [tool["function"]["name"] for tool in stub.requests[0]["tools"]] == ["transfer_to_billing_agent"]
    second = stub.messages()
    assert second[0] == {"role": "system", "content": "You answer billing questions."}
    assert [m["role"] for m in second] == ["system", "user", "assistant", "tool"]
    assert second[2]["tool_calls"][0]["id"] == "call_handoff" and second[3]["tool_call_id"] == "call_handoff"
    [conversation] = await conversations(http_daemon)
    (first_in, first_out), (second_in, second_out) = await exchanges(http_daemon, conversation["conversation_id"])
    assert texts(first_in) == [("user", "I was charged twice this month.")]
    assert [(item["type"], item.get("call_id"), item.get("name")) for item in first_out] == [
        ("function_call", "call_handoff", "transfer_to_billing_agent")]
    assert [(item["type"], item["call_id"]) for item in second_in] == [("function_call_output", "call_handoff")]
    assert json.loads(second_in[0]["output"]) == {"assistant": "Billing agent"}
    assert texts(second_out) == [("assistant", "A refund of the second charge is on its way.")]
