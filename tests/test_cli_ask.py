"""`ksi ask`, run as a real process (`python -m ksi_cli ask ...`) against an in-process daemon.

The CLI runs with asyncio.create_subprocess_exec so this loop keeps serving the daemon
while the CLI waits for its answer; the `echo/...` model needs no network.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.conftest import PROVIDER_PREFIXES, running_daemon, stub_settings

TIMEOUT = 60.0


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(PROVIDER_PREFIXES)}
    env.update({"OPENAI_API_KEY": "sk-test-dummy", "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    return env


@dataclass
class Run:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)

    def error(self) -> Any:
        """The error, printed on stderr as one JSON line when stdout is not a terminal."""
        return json.loads(self.err.splitlines()[0])["error"]


async def ksi(root: Path, *args: str, stdin: bytes | None = None, env: dict[str, str] | None = None) -> Run:
    """`ksi ARGS` in `root` (so no stray .env is read), output piped; `env` added to the clean one."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "ksi_cli", *args, cwd=root, env={**clean_env(), **(env or {})},
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(stdin), TIMEOUT)
    assert process.returncode is not None
    return Run(process.returncode, out.decode(), err.decode())


async def ksi_on_terminal(root: Path, *args: str) -> Run:
    """`ksi ARGS` with its standard output on a pseudo-terminal."""
    master, slave = os.openpty()
    try:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "ksi_cli", *args, cwd=root, env=clean_env(),
            stdin=asyncio.subprocess.DEVNULL, stdout=slave, stderr=asyncio.subprocess.PIPE,
        )
        os.close(slave)
        slave = -1
        _out, err = await asyncio.wait_for(process.communicate(), TIMEOUT)
        chunks = []
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child's side is closed and everything was read
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(master)
        if slave >= 0:
            os.close(slave)
    assert process.returncode is not None
    return Run(process.returncode, b"".join(chunks).decode().replace("\r\n", "\n"), err.decode())


def where(root: Path) -> list[str]:
    return ["--var-dir", str(root / "var"), "--socket", str(root / "d.sock")]


def recorded(root: Path) -> dict[str, Any]:
    return json.loads((root / "var" / "state" / "client.json").read_text())["last_ask"]


async def test_continue_remembers_the_last_ask(short_tmp: Path) -> None:
    async with running_daemon(short_tmp):
        first = await ksi(short_tmp, "ask", "--json", "My name is Alice", *where(short_tmp))
        assert first.code == 0, first.err
        result = first.json()
        assert "You said: My name is Alice" in result["content"]
        assert "Earlier user inputs: none" in result["content"]
        assert recorded(short_tmp)["conversation_id"] == result["conversation_id"]

        second = await ksi(short_tmp, "ask", "--json", "--continue", "What is my name?", *where(short_tmp))
        assert second.code == 0, second.err
        answer = second.json()
        assert "Earlier user inputs: My name is Alice" in answer["content"]
        assert answer["conversation_id"] == result["conversation_id"]
        assert answer["response_id"] != result["response_id"]
        assert answer["history"]["exchanges_sent"] == 1
        assert recorded(short_tmp)["response_id"] == answer["response_id"]

        # the index holds both exchanges, in order
        index = (short_tmp / "var" / "logs" / "conversations" / f"{result['conversation_id']}.jsonl")
        lines = [json.loads(line) for line in index.read_text().splitlines()]
        assert [line["response_id"] for line in lines] == [result["response_id"], answer["response_id"]]


async def test_terminal_shows_answer_then_ids(short_tmp: Path) -> None:
    async with running_daemon(short_tmp):
        first = await ksi_on_terminal(short_tmp, "ask", "My name is Alice", *where(short_tmp))
        assert first.code == 0, first.err
        second = await ksi_on_terminal(short_tmp, "ask", "--continue", "What is my name?", *where(short_tmp))
        assert second.code == 0, second.err
    conversation = recorded(short_tmp)["conversation_id"]
    text = second.out
    assert text.startswith("You said: What is my name?")
    assert "Earlier user inputs: My name is Alice" in text
    assert not text.lstrip().startswith("{")
    assert "conversation" not in text  # the answer alone on stdout; the ids on stderr
    last = second.err.rstrip("\n").splitlines()[-1]
    assert f"conversation {conversation}" in last
    assert f"response {recorded(short_tmp)['response_id']}" in last
    assert "echo/default" in last
    assert f"conversation {conversation}" in first.err  # the same conversation both times


async def test_json_flag_model_system_and_stdin(short_tmp: Path) -> None:
    async with running_daemon(short_tmp):
        run = await ksi(short_tmp, "ask", "--json", "--model", "echo/other", "--system", "Be brief",
                        "-", *where(short_tmp), stdin=b"Hello from stdin")
        assert run.code == 0, run.err
        result = run.json()
        assert result["model"] == "echo/other"
        assert "You said: Hello from stdin" in result["content"]
        assert "Messages received: 2 (system: 1)" in result["content"]
        # --conversation continues a named conversation, with the conversation's last model
        again = await ksi(short_tmp, "ask", "--json", "--conversation", result["conversation_id"], "Still there?",
                          *where(short_tmp))
        assert again.code == 0, again.err
        follow = again.json()
        assert follow["model"] == "echo/other"
        assert "Earlier user inputs: Hello from stdin" in follow["content"]
        assert recorded(short_tmp)["conversation_id"] == result["conversation_id"]


async def test_unknown_conversation_exits_1_and_keeps_the_record(short_tmp: Path) -> None:
    async with running_daemon(short_tmp):
        ok = await ksi(short_tmp, "ask", "hello", *where(short_tmp))
        assert ok.code == 0, ok.err
        before = recorded(short_tmp)
        run = await ksi(short_tmp, "ask", "--conversation", "conv-nope", "hello", *where(short_tmp))
        assert run.code == 1
        assert run.out == ""
        assert run.error()["code"] == "conversation_not_found"
        bad = await ksi(short_tmp, "ask", "--conversation", "../etc", "hello", *where(short_tmp))
        assert bad.code == 1
        assert bad.error()["code"] == "validation_error"
    assert recorded(short_tmp) == before  # failures never move the --continue record
    assert not (short_tmp / "var" / "logs" / "conversations" / "conv-nope.jsonl").exists()


async def test_error_on_terminal_shows_the_code(short_tmp: Path) -> None:
    async with running_daemon(short_tmp):
        run = await ksi_on_terminal(short_tmp, "ask", "--cid", "conv-nope", "hello", *where(short_tmp))
    assert run.code == 1
    assert "error [conversation_not_found]" in run.err


async def test_no_answer_within_the_timeout_exits_1(short_tmp: Path, stub: Any) -> None:
    stub.hold = 2.0
    async with running_daemon(short_tmp, **stub_settings(stub)):
        run = await ksi(short_tmp, "ask", "--timeout", "0.3", "slow question", *where(short_tmp))
        assert run.code == 1
        error = run.error()
        assert error["code"] == "timeout"
        assert error["details"]["status"] in ("queued", "running")
        assert "completion:wait --request-id" in run.err
    assert not (short_tmp / "var" / "state" / "client.json").exists()


async def test_continue_without_a_record_is_a_usage_error(short_tmp: Path) -> None:
    async with running_daemon(short_tmp):
        run = await ksi(short_tmp, "ask", "--continue", "What is my name?", *where(short_tmp))
    assert run.code == 2
    assert "no earlier `ksi ask`" in run.err
    assert "client.json" in run.err
    assert not list((short_tmp / "var" / "logs" / "conversations").glob("*.jsonl"))


async def test_conversation_and_continue_together_is_a_usage_error(short_tmp: Path) -> None:
    async with running_daemon(short_tmp):
        run = await ksi(short_tmp, "ask", "--conversation", "conv-x", "--continue", "hi", *where(short_tmp))
    assert run.code == 2
    assert "not both" in run.err


async def test_empty_question_is_a_usage_error(short_tmp: Path) -> None:
    run = await ksi(short_tmp, "ask", "  ", *where(short_tmp))
    assert run.code == 2
    missing = await ksi(short_tmp, "ask", *where(short_tmp))
    assert missing.code == 2


async def test_daemon_down_exits_3_and_says_how_to_start(short_tmp: Path) -> None:
    run = await ksi(short_tmp, "ask", "hello", *where(short_tmp))
    assert run.code == 3
    assert run.error()["code"] == "daemon_unreachable"
    assert f"ksi daemon start --var-dir {short_tmp / 'var'} --socket {short_tmp / 'd.sock'}" in run.err
    assert not (short_tmp / "var" / "state" / "client.json").exists()


async def test_client_path_stays_light(short_tmp: Path) -> None:
    code = ("import sys, ksi_cli.main, ksi_cli.ask\n"
            "heavy = ('pydantic', 'pydantic_settings', 'litellm', 'ksi_daemon', 'openai', 'httpx', 'aiohttp')\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n")
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, cwd=short_tmp, env=clean_env(), stdout=asyncio.subprocess.PIPE)
    out, _ = await asyncio.wait_for(process.communicate(), TIMEOUT)
    assert out.decode().strip() == "[]"
