"""The real Claude Code CLI (pinned, from npm, in the cached client node_modules) with
ANTHROPIC_BASE_URL at the daemon and the tool-calling stub as its model: `claude -p` with a task
that makes it read a file, then `claude -p --continue` twice. Claude Code resends its whole
session each turn: KSI keeps ONE conversation, and every later turn replays the tool_use and its
tool_result to the provider, paired."""

from __future__ import annotations

import asyncio
import os
from collections import deque
from pathlib import Path
from typing import Any

import pytest

from ksi_daemon.context import EventContext
from tests.client_node import client_node_modules, node_bin
from tests.conftest import HttpDaemon, running_http_daemon, stub_settings
from tests.stub_openai import Reply, StubOpenAI

CLAUDE_CODE = "@anthropic-ai/claude-code@2.1.328"
MODEL = "openai/stub-model"


def claude_env(http: HttpDaemon, home: Path) -> dict[str, str]:
    """What a user sets to point Claude Code at KSI (and no traffic of its own elsewhere)."""
    return {"PATH": os.environ["PATH"], "HOME": str(home), "ANTHROPIC_BASE_URL": http.base_url,
            "ANTHROPIC_API_KEY": http.token, "ANTHROPIC_MODEL": MODEL, "ANTHROPIC_SMALL_FAST_MODEL": MODEL,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1"}


async def claude(binary: Path, work: Path, env: dict[str, str], *args: str) -> str:
    process = await asyncio.create_subprocess_exec(str(binary), *args, cwd=work, env=env,
                                                   stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(process.communicate(), 180)
    assert process.returncode == 0, err.decode()[-2000:]
    return out.decode().strip()


def pairs(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The calls and results a provider request holds, in order."""
    found = []
    for message in messages:
        for made in message.get("tool_calls") or []:
            found.append(("call", made["id"]))
        if message["role"] == "tool":
            found.append(("result", message["tool_call_id"]))
    return found


@pytest.fixture
async def http(short_tmp: Path, stub: StubOpenAI) -> Any:
    # Claude Code asks for up to 32000 answer tokens: the stub model is given a window that holds them
    models = {"openai/stub*": {"api_base": stub.api_base, "context_window": 200_000}}
    async with running_http_daemon(short_tmp, **stub_settings(stub, models=models)) as running:
        yield running


async def test_claude_code_keeps_one_conversation_with_its_tool_pairs(
        http: HttpDaemon, stub: StubOpenAI, short_tmp: Path) -> None:
    binary = node_bin(await asyncio.to_thread(client_node_modules, (CLAUDE_CODE,)), "claude")
    home, work = short_tmp / "home", short_tmp / "work"
    home.mkdir()
    work.mkdir()
    (work / "notes.txt").write_text("the answer is 42\n")
    stub.model_script["stub-model"] = deque([
        Reply(calls=[{"id": "toolu_read1", "name": "Read", "arguments": {"file_path": str(work / "notes.txt")}}]),
        Reply(text="The file says 42."), Reply(text="You are welcome."), Reply(text="Bye.")])
    env = claude_env(http, home)
    assert await claude(binary, work, env, "-p", "What does notes.txt say?", "--allowedTools", "Read") \
        == "The file says 42."
    assert await claude(binary, work, env, "-p", "--continue", "thanks") == "You are welcome."
    assert await claude(binary, work, env, "-p", "--continue", "bye") == "Bye."

    listing = await http.daemon.router.request("conversation:list", {"limit": 100}, EventContext.root())
    assert [c["exchanges"] for c in listing["conversations"]] == [4]  # the call, its result, two more turns
    read = [m for m in stub.messages(1) if m["role"] == "tool"]
    assert "the answer is 42" in read[0]["content"]  # Claude Code ran the tool and sent its result
    for later in (2, 3):  # each continued turn replays the pair to the provider
        assert pairs(stub.messages(later)) == [("call", "toolu_read1"), ("result", "toolu_read1")]
    assert [m["role"] for m in stub.messages(3)][-4:] == ["assistant", "user", "assistant", "user"]
    assert stub.messages(3)[-1]["content"].endswith("bye")
