"""`ksi chat` and `ksi agents` as real processes against an in-process daemon.

The CLI runs through asyncio.create_subprocess_exec so this loop keeps serving the daemon.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from ksi_common.client import KsiClient
from ksi_common.records import read_index
from ksi_daemon.daemon import Daemon
from tests.conftest import PROVIDER_PREFIXES, connected

TIMEOUT = 60.0


def cli_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(PROVIDER_PREFIXES)}
    env["PYTHONPATH"] = str(Path(__file__).parent.parent)
    return env


async def ksi(daemon: Daemon, *args: str, stdin: str = "") -> tuple[int, str, str]:
    """Run `ksi ARGS --socket S` with `stdin` piped in; returns exit code, stdout, stderr."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "ksi_cli", *args, "--socket", str(daemon.settings.socket),
        cwd=daemon.layout.root.parent, env=cli_env(),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(stdin.encode()), TIMEOUT)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def chunked_requests(watcher: KsiClient) -> set[str]:
    """Request ids of the completion:chunk pushes received so far."""
    ids = set()
    while True:
        try:
            frame = await watcher.next_push(0.2)
        except TimeoutError:
            return ids
        if frame is None:
            return ids
        if frame["event"] == "completion:chunk":
            ids.add(frame["data"]["request_id"])


async def test_chat_two_turns_then_resume(daemon: Daemon) -> None:
    async with connected(daemon) as watcher:
        await watcher.request("monitor:subscribe", {"patterns": ["completion:chunk"]})
        code, out, err = await ksi(daemon, "chat", "--profile", "assistant", stdin="hello\n\nsecond message\n")
        assert code == 0, err
        agent_id = re.search(r"^agent (agent_[0-9a-f]{8}) \(profile assistant", out, re.M).group(1)
        assert f"conversation {agent_id}, 0 exchanges so far" in out
        replies = [line for line in out.splitlines() if line.startswith(f"{agent_id}> ")]
        assert replies == [f"{agent_id}> You said: hello", f"{agent_id}> You said: second message"]
        assert "Earlier user inputs: hello\n" in out
        index = read_index(daemon.layout.index_file(agent_id))
        assert len(index) == 2  # the empty line was not sent
        # the replies were streamed: every exchange's request pushed chunks
        streamed = await chunked_requests(watcher)
        requests = {json.loads(daemon.layout.response_file(e.response_id).read_text().splitlines()[0])["request_id"]
                    for e in index}
        assert requests <= streamed

        code, out, err = await ksi(daemon, "chat", agent_id, stdin="third\n/quit\nnever sent\n")
        assert code == 0, err
        assert f"conversation {agent_id}, 2 exchanges so far" in out
        assert "You said: third" in out
        assert "Earlier user inputs: hello | second message" in out
        assert len(read_index(daemon.layout.index_file(agent_id))) == 3


async def test_chat_without_streaming_and_named_new_agent(daemon: Daemon) -> None:
    code, out, err = await ksi(daemon, "chat", "named", "--profile", "assistant", "--model", "echo/x",
                               "--no-stream", stdin="hi\n")
    assert code == 0, err
    assert "agent named (profile assistant, model echo/x)" in out
    assert "named> You said: hi" in out
    code, _out, err = await ksi(daemon, "chat", "named", "--profile", "assistant", stdin="")
    assert code == 1 and "agent_exists" in err


async def test_chat_refusals(daemon: Daemon, client: KsiClient) -> None:
    code, _out, err = await ksi(daemon, "chat", "nobody", stdin="hi\n")
    assert code == 1 and "error [agent_not_found]" in err and "--profile" in err
    code, _out, err = await ksi(daemon, "chat", "--profile", "no-such", stdin="hi\n")
    assert code == 1 and "error [profile_not_found]" in err
    code, _out, err = await ksi(daemon, "chat", stdin="")
    assert code == 2 and "AGENT_ID" in err
    await client.request("agent:spawn", {"agent_id": "gone", "profile": "assistant"})
    await client.request("agent:terminate", {"agent_id": "gone"})
    code, _out, err = await ksi(daemon, "chat", "gone", stdin="hi\n")
    assert code == 1 and "agent_terminated" in err
    assert not daemon.layout.index_file("gone").exists()


async def test_agents_command_lists_agents(daemon: Daemon, client: KsiClient) -> None:
    code, out, err = await ksi(daemon, "agents", "--json")
    assert code == 0, err
    assert json.loads(out) == {"agents": [], "count": 0}
    await client.request("agent:spawn", {"agent_id": "one", "profile": "assistant"})
    await client.request("agent:spawn", {"agent_id": "two", "profile": "coordinator"})
    await client.request("agent:terminate", {"agent_id": "two"})
    code, out, err = await ksi(daemon, "agents")  # piped: JSON
    listed: dict[str, Any] = json.loads(out)
    assert [(a["agent_id"], a["profile"], a["status"]) for a in listed["agents"]] == [
        ("one", "assistant", "active"), ("two", "coordinator", "terminated")]
    code, out, err = await ksi(daemon, "agents", "--status", "active", "--json")
    assert [a["agent_id"] for a in json.loads(out)["agents"]] == ["one"]
    code, _out, err = await ksi(daemon, "agents", "--status", "sleeping")
    assert code == 2


def test_agents_table_output(capsys: Any, monkeypatch: Any) -> None:
    """On a terminal the list is a table (the rendering path, without a daemon)."""
    from ksi_cli import agents as agents_module

    reply = {"agents": [{"agent_id": "one", "profile": "assistant", "model": "echo/default", "status": "active",
                         "exchanges": 3, "last_activity": "2026-01-01T00:00:00.000000Z"}], "count": 1}
    monkeypatch.setattr(agents_module.oneshot, "request", lambda *a, **k: reply)
    monkeypatch.setattr(agents_module, "wants_json", lambda flag: False)
    agents_module.agents.main([], standalone_mode=False)
    out = capsys.readouterr().out
    assert "1 agent" in out and "one" in out and "echo/default" in out and "assistant" in out


async def test_unreachable_daemon(short_tmp: Path) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "ksi_cli", "chat", "x", "--socket", str(short_tmp / "none.sock"),
        cwd=short_tmp, env=cli_env(), stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    _out, err = await asyncio.wait_for(process.communicate(), TIMEOUT)
    assert process.returncode == 3 and "daemon_unreachable" in err.decode()


async def test_a_new_chat_names_its_conversation_and_exit_or_quit_end_it(daemon: Daemon) -> None:
    for word in ("exit", "quit", "  Exit "):
        code, out, err = await ksi(daemon, "chat", "--model", "echo/x", stdin=f"hello\n{word}\nnever sent\n")
        assert code == 0, err
        conversation_id = re.search(r"^a new conversation (conv-[0-9a-f]{12}) with echo/x$", out, re.M).group(1)
        assert "You said: hello" in out and "never sent" not in out
        assert f"resume with: ksi chat --cid {conversation_id}" in out
        index = read_index(daemon.layout.index_file(conversation_id))
        assert len(index) == 1  # the word that ends the chat never reached the model
    code, out, err = await ksi(daemon, "chat", "--model", "echo/x", stdin="exit\n")
    assert code == 0, err
    assert "resume with" not in out  # nothing was said: no conversation to resume
    named = re.search(r"^a new conversation (conv-[0-9a-f]{12})", out, re.M).group(1)
    assert not daemon.layout.index_file(named).exists()
