"""Agent frameworks nobody here wrote, used as their own docs tell a user to, against the
OpenAI-compatible door of a real daemon (real litellm, the local stub). They need a newer `openai`
than litellm allows, so they run in a virtualenv of their own (tests/client_venvs.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ksi_daemon.context import EventContext
from tests.client_venvs import AGENT_CLIENTS, client_python, run_client
from tests.conftest import HttpDaemon
from tests.stub_openai import StubOpenAI


@pytest.fixture(scope="session")
def clients_python() -> Path:
    return client_python(AGENT_CLIENTS)


def client_env(http: HttpDaemon) -> dict[str, str]:
    return {"KSI_BASE_URL": f"{http.base_url}/v1", "KSI_TOKEN": http.token, "OPENAI_AGENTS_DISABLE_TRACING": "1"}


LANGCHAIN_CHAT = """
import json, os
from langchain_openai import ChatOpenAI
model = ChatOpenAI(model="openai/stub-model", base_url=os.environ["KSI_BASE_URL"], api_key=os.environ["KSI_TOKEN"],
                   max_retries=0)
reply = model.invoke("Say hello to the framework")
print(json.dumps({"content": reply.content}))
"""

AGENTS_CHAT = """
import asyncio, json, os
from openai import AsyncOpenAI
from agents import Agent, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
set_tracing_disabled(True)
client = AsyncOpenAI(base_url=os.environ["KSI_BASE_URL"], api_key=os.environ["KSI_TOKEN"], max_retries=0)
agent = Agent(name="helper", instructions="Answer briefly.",
              model=OpenAIChatCompletionsModel(model="openai/stub-model", openai_client=client))
result = asyncio.run(Runner.run(agent, "What is the plan?"))
print(json.dumps({"final": result.final_output}))
"""


async def test_langchain_chat_model_answers_through_the_door(
        clients_python: Path, http_daemon: HttpDaemon, stub: StubOpenAI) -> None:
    stub.enqueue("hello from the stub")
    out = await run_client(clients_python, LANGCHAIN_CHAT, client_env(http_daemon))
    assert out["content"] == "hello from the stub"
    assert stub.messages()[-1]["content"] == "Say hello to the framework"


async def test_an_openai_agents_run_over_chat_completions_is_stored_as_a_conversation(
        clients_python: Path, http_daemon: HttpDaemon, stub: StubOpenAI) -> None:
    stub.enqueue("the plan is simple")
    out = await run_client(clients_python, AGENTS_CHAT, client_env(http_daemon))
    assert out["final"] == "the plan is simple"
    sent = stub.messages()
    assert sent[0] == {"role": "system", "content": "Answer briefly."}
    assert sent[-1]["content"] == "What is the plan?"
    listed = await http_daemon.daemon.router.request("conversation:list", {}, EventContext.root())
    [conversation] = listed["conversations"]
    assert conversation["exchanges"] == 1
