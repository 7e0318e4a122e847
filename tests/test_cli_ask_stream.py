"""`ksi ask` as a daily tool: streamed on a real pseudo-terminal, piped stdin, model options,
files, agents and Ctrl-C, each a real `ksi` process against an in-process daemon."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import sys
from pathlib import Path
from typing import Any

import pexpect

from ksi_common.client import KsiClient
from tests.conftest import running_daemon, stub_settings
from tests.stub_openai import Reply
from tests.test_cli_ask import clean_env, ksi, where

TIMEOUT = 30


def _interruptible() -> None:
    # A suite started in the background of a non-interactive shell ignores SIGINT, and children
    # inherit that; Python then raises no KeyboardInterrupt. A user's terminal does not do this.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def spawn(root: Path, *args: str) -> pexpect.spawn:
    """`ksi ARGS` with stdin, stdout and stderr on one pseudo-terminal."""
    return pexpect.spawn(sys.executable, ["-m", "ksi_cli", *args], cwd=str(root), env=clean_env(),
                         encoding="utf-8", timeout=TIMEOUT, dimensions=(40, 200), preexec_fn=_interruptible)


async def expect(child: pexpect.spawn, pattern: Any) -> str:
    """Wait for `pattern` off the event loop (the daemon runs on it); returns what came before."""
    await asyncio.to_thread(child.expect, pattern)
    return str(child.before)


async def finish(child: pexpect.spawn) -> tuple[str, int]:
    rest = await expect(child, pexpect.EOF)
    child.close()
    return rest, child.exitstatus if child.exitstatus is not None else 128 + (child.signalstatus or 0)


async def test_the_first_chunk_is_on_the_terminal_before_the_rest_exists(short_tmp: Path, stub: Any) -> None:
    gate = asyncio.Event()
    stub.enqueue(Reply(text="alpha beta gamma", delay=0.4, gate=gate))
    async with running_daemon(short_tmp, **stub_settings(stub)):
        child = spawn(short_tmp, "ask", "hello there", *where(short_tmp))
        before = await expect(child, "alpha")
        assert "thinking" in before  # the spinner, while nothing had come
        # the provider holds "beta gamma" until the gate opens: what is shown came as a chunk
        gate.set()
        rest, code = await finish(child)
    assert code == 0, rest
    assert "beta gamma" in rest
    conversation = re.search(r"conversation (\S+)", rest)
    assert conversation and "openai/stub-model" in rest and "in / " in rest  # the summary line
    assert "{" not in rest  # no JSON on a terminal


async def test_ctrl_c_cancels_the_request_in_the_daemon(short_tmp: Path, stub: Any) -> None:
    gate = asyncio.Event()
    stub.enqueue(Reply(text="partial answer never finished", gate=gate))
    async with running_daemon(short_tmp, **stub_settings(stub)) as daemon:
        child = spawn(short_tmp, "ask", "a long one", *where(short_tmp))
        await expect(child, "partial")
        child.sendintr()
        rest, code = await finish(child)
        assert code == 130
        request_id = re.search(r"cancelled request (\S+)", rest)
        assert request_id, rest
        assert "Traceback" not in rest
        async with KsiClient(daemon.settings.socket) as client:
            status = await client.request("completion:status", {"request_id": request_id.group(1)})
        assert status["status"] == "cancelled"
        gate.set()


async def test_piped_stdin_joins_the_prompt_and_the_answer_is_plain_text(short_tmp: Path) -> None:
    async with running_daemon(short_tmp):
        run = await ksi(short_tmp, "ask", "--model", "echo/demo", "summarise", *where(short_tmp),
                        stdin=b"line one\nline two\n")
    assert run.code == 0, run.err
    assert run.out.startswith("You said: line one\nline two\n\nsummarise")
    assert not run.out.lstrip().startswith("{")
    assert "conversation " in run.err and "conversation " not in run.out


async def test_model_options_files_and_system_reach_the_provider(short_tmp: Path, stub: Any) -> None:
    attached = short_tmp / "notes.txt"
    attached.write_text("the attached words\n")
    async with running_daemon(short_tmp, allowed_file_roots=[short_tmp], **stub_settings(stub)):
        run = await ksi(short_tmp, "ask", "-o", "temperature", "0.5", "-o", "seed", "7", "-o", "stop", '["X"]',
                        "--files", "notes.txt", "--system", "Be terse", "--json", "read it", *where(short_tmp))
        assert run.code == 0, run.err
        sent = stub.requests[-1]
        assert (sent["temperature"], sent["seed"], sent["stop"]) == (0.5, 7, ["X"])
        text = json.dumps(sent["messages"])
        assert "the attached words" in text and "Be terse" in text
        bad = await ksi(short_tmp, "ask", "-o", "temperature", "NaN", "hi", *where(short_tmp))
        assert bad.code == 2 and "-o" in bad.err


async def test_agent_and_named_conversation(short_tmp: Path) -> None:
    async with running_daemon(short_tmp) as daemon:
        async with KsiClient(daemon.settings.socket) as client:
            await client.request("agent:spawn", {"agent_id": "helper", "profile": "assistant", "model": "echo/agent"})
        first = await ksi(short_tmp, "ask", "--json", "--agent", "helper", "note 1", *where(short_tmp))
        assert first.code == 0, first.err
        result = first.json()
        assert (result["agent_id"], result["model"]) == ("helper", "echo/agent")
        again = await ksi(short_tmp, "ask", "--json", "--cid", result["conversation_id"], "and 2", *where(short_tmp))
        assert again.code == 0, again.err
        assert "Earlier user inputs: note 1" in again.json()["content"]
        cont = await ksi(short_tmp, "ask", "-c", "and 3", *where(short_tmp))
        assert cont.code == 0, cont.err
        assert "Earlier user inputs: note 1 | and 2" in cont.out
