"""The real Codex CLI (`@openai/codex`, pinned, from npm) pointed at KSI as a custom provider with
`wire_api = "responses"`, WebSocket mode off, the stub behind KSI calling Codex's shell tool: `codex
exec`, then two `codex exec resume --last`. One KSI conversation holds every turn; every tool call
and its output is replayed to the provider on the later turns (read from the stub's log); nothing
is refused. Codex sends what it always sends: include, reasoning.summary, prompt_cache_key,
client_metadata, a namespace tool and web_search (dropped by the model's setting)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from ksi_common.client import KsiClient
from tests.client_node import client_node_modules, node_bin
from tests.conftest import HttpDaemon, connected, running_http_daemon, stub_settings
from tests.stored import stored_index
from tests.stub_openai import Reply, StubOpenAI

pytestmark = pytest.mark.backends

CODEX = ("@openai/codex@0.169.0",)
MODELS = ("openai/stub-codex", "anthropic/stub-codex")  # behind KSI: an OpenAI-style and an Anthropic-style API


def codex_config(http: HttpDaemon, model: str) -> str:
    """What docs/codex.md tells a user to write in CODEX_HOME/config.toml."""
    return f'''model = "{model}"
model_provider = "ksi"

[model_providers.ksi]
name = "KSI"
base_url = "{http.base_url}/v1"
env_key = "CODEX_KSI_TOKEN"
wire_api = "responses"
supports_websockets = false
request_max_retries = 0
stream_max_retries = 0
'''


@pytest.fixture(scope="module")
def codex_bin() -> Path:
    if shutil.which("npm") is None or shutil.which("node") is None:
        pytest.fail("node and npm are needed to install the pinned Codex CLI")
    return node_bin(client_node_modules(CODEX), "codex")


@pytest.fixture
async def http(short_tmp: Path, stub: StubOpenAI, backend: dict[str, Any],
               monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[HttpDaemon]:
    monkeypatch.setenv("KSI_TEST_ANTHROPIC_KEY", "sk-ant-stub")
    models = {"openai/stub-codex": {"api_base": stub.api_base, "drop_hosted_tools": ["web_search"]},
              "anthropic/stub-codex": {"api_base": f"http://127.0.0.1:{stub.port}", "drop_hosted_tools": ["web_search"],
                                       "api_key_env": "KSI_TEST_ANTHROPIC_KEY"}}
    async with running_http_daemon(short_tmp, **stub_settings(stub, models=models), **backend) as running:
        yield running


async def run_codex(codex: Path, home: Path, work: Path, token: str, *args: str) -> str:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("OPENAI_", "CODEX_"))}
    env.update(CODEX_HOME=str(home), CODEX_KSI_TOKEN=token, NO_COLOR="1")
    process = await asyncio.create_subprocess_exec(
        str(codex), "exec", *args, cwd=work, env=env, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(process.communicate(), timeout=180)
    said = out.decode() + err.decode()
    assert process.returncode == 0, said
    assert "ERROR" not in said, said
    return said


def shell_call(call_id: str, marker: str, anthropic: bool) -> Reply:
    """A call of Codex's shell tool, with reasoning beside it (Codex resends it as a reasoning item)."""
    thinking = {"thinking": (f"run {marker}", f"sig-{marker}")} if anthropic else {"reasoning": f"run {marker}"}
    return Reply(calls=[{"id": call_id, "name": "exec_command", "arguments": {"cmd": f"echo {marker}"}}], **thinking)


def calls_and_outputs(stub: StubOpenAI, anthropic: bool, index: int) -> tuple[list[str], dict[str, str]]:
    """The tool calls and outputs the provider was sent in its request `index`, in either API."""
    if not anthropic:
        messages = stub.messages(index)
        calls = [call["id"] for message in messages for call in message.get("tool_calls") or []]
        return calls, {m["tool_call_id"]: str(m["content"]) for m in messages if m["role"] == "tool"}
    blocks = [block for message in stub.anthropic_requests[index]["messages"] if isinstance(message["content"], list)
              for block in message["content"]]
    calls = [block["id"] for block in blocks if block["type"] == "tool_use"]
    return calls, {block["tool_use_id"]: json.dumps(block["content"]) for block in blocks if block["type"] == "tool_result"}


def sent(stub: StubOpenAI, anthropic: bool) -> list[dict[str, Any]]:
    return stub.anthropic_requests if anthropic else stub.requests


async def conversations(client: KsiClient) -> list[str]:
    listed = await client.request("conversation:list", {})
    return [entry["conversation_id"] for entry in listed["conversations"]]


async def exec_and_two_resumes(codex_bin: Path, home: Path, work: Path, token: str, stub: StubOpenAI,
                               anthropic: bool) -> None:
    """`codex exec` running one shell command, a resume running another, a resume answering."""
    stub.enqueue(shell_call("call_one", "ksi-marker-one", anthropic), Reply(text="Ran the first command."))
    first = await run_codex(codex_bin, home, work, token, "--skip-git-repo-check", "-s", "danger-full-access",
                            "Run the first command")
    assert "ksi-marker-one" in first and "Ran the first command." in first
    stub.enqueue(shell_call("call_two", "ksi-marker-two", anthropic), Reply(text="Ran the second command."))
    second = await run_codex(codex_bin, home, work, token, "resume", "--last", "--skip-git-repo-check",
                             "Run the second command")
    assert "ksi-marker-two" in second and "Ran the second command." in second
    stub.enqueue(Reply(text="Both commands ran."))
    third = await run_codex(codex_bin, home, work, token, "resume", "--last", "--skip-git-repo-check",
                            "What did you run?")
    assert "Both commands ran." in third


@pytest.mark.parametrize("model", MODELS)
async def test_codex_exec_and_two_resumes_keep_one_conversation_with_its_shell_calls(
        codex_bin: Path, http: HttpDaemon, stub: StubOpenAI, tmp_path: Path, model: str) -> None:
    anthropic = model.startswith("anthropic/")
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (home / "config.toml").write_text(codex_config(http, model))

    await exec_and_two_resumes(codex_bin, home, work, http.token, stub, anthropic)

    requests = sent(stub, anthropic)
    assert len(requests) == 5  # call, answer; call, answer; answer: nothing refused, nothing retried
    assert [tool.get("name") or tool["function"]["name"] for tool in requests[0]["tools"]][0] == "exec_command"
    calls, outputs = calls_and_outputs(stub, anthropic, -1)
    assert calls == ["call_one", "call_two"]  # every call replayed on the last turn
    assert "ksi-marker-one" in outputs["call_one"] and "ksi-marker-two" in outputs["call_two"]
    calls, outputs = calls_and_outputs(stub, anthropic, 2)  # the second exec's first request
    assert calls == ["call_one"] and "ksi-marker-one" in outputs["call_one"]
    if anthropic:  # its own signed thinking goes back with its calls
        thinking = [block for message in requests[-1]["messages"] if isinstance(message["content"], list)
                    for block in message["content"] if block["type"] == "thinking"]
        assert [block["signature"] for block in thinking] == ["sig-ksi-marker-one", "sig-ksi-marker-two"]
    else:
        assert "prompt_cache_key" in requests[0] and "client_metadata" not in requests[0]
        assert not any("reasoning_content" in message for message in stub.messages(-1))

    async with connected(http.daemon) as client:
        [conversation] = await conversations(client)
    index = await stored_index(http.daemon, conversation)
    assert len(index) == 5
