"""The `llm` plugin: the real `llm` command, as a subprocess, against an in-process daemon and
local OpenAI-compatible stubs; `llm`'s own user directory is a temporary folder.

`llm` runs through asyncio.create_subprocess_exec (and `llm chat` under pexpect in a thread) so
this loop keeps serving the daemon.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pexpect

from ksi_common.records import read_index
from ksi_daemon.daemon import Daemon
from tests.conftest import PROVIDER_PREFIXES, connected, running_daemon
from tests.stub_openai import Reply, StubOpenAI

TIMEOUT = 60.0
BIN = Path(sys.executable).parent
Answer = Callable[[list[dict[str, Any]]], str]


def last_user(messages: list[dict[str, Any]]) -> str:
    return next((str(m["content"]) for m in reversed(messages) if m["role"] == "user"), "")


def member(name: str) -> Answer:
    return lambda messages: f"{name} heard: {last_user(messages)}"


def verdict(synthesis: str) -> str:
    return json.dumps({"synthesis": synthesis, "confidence": 0.95, "dissent": "", "refinement_areas": [],
                       "needs_iteration": False, "ranking": [1]})


@dataclass
class Place:
    """A daemon on its stubs, and the environment an `llm` process gets to reach it."""

    daemon: Daemon
    stubs: dict[str, StubOpenAI]
    root: Path

    @property
    def socket(self) -> Path:
        return self.daemon.settings.socket

    def env(self, socket: Path | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(PROVIDER_PREFIXES)}
        env.update(LLM_USER_PATH=str(self.root / "llm"), KSI_VAR_DIR=str(self.daemon.settings.var_dir),
                   KSI_SOCKET_PATH=str(socket or self.socket), PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
        return env

    async def run(self, program: str, *args: str, socket: Path | None = None) -> tuple[int, str, str]:
        process = await asyncio.create_subprocess_exec(
            str(BIN / program), *args, cwd=self.root, env=self.env(socket), stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(process.communicate(), TIMEOUT)
        assert process.returncode is not None
        return process.returncode, out.decode(), err.decode()

    async def llm(self, *args: str, socket: Path | None = None) -> str:
        code, out, err = await self.run("llm", *args, socket=socket)
        assert code == 0, err
        return out

    async def llm_logs(self) -> list[dict[str, Any]]:
        """Every response `llm logs` shows, oldest first."""
        return json.loads(await self.llm("logs", "--json", "-n", "0"))

    async def logs(self) -> list[dict[str, Any]]:
        """Every turn `llm` logged, oldest first, read from its database (no process to start)."""
        path = self.root / "llm" / "logs.db"
        if not path.exists():
            return []
        with sqlite3.connect(path) as db:
            db.row_factory = sqlite3.Row
            rows = [dict(row) for row in db.execute("select * from turns order by id")]
        for row in rows:
            row["conversation_id"] = row["thread_id"]
            row["response_json"] = json.loads(row["response_json"]) if row["response_json"] else None
        return rows

    def index(self, conversation_id: str) -> list[Any]:
        return read_index(self.daemon.layout.index_file(conversation_id))


@asynccontextmanager
async def place(root: Path, answers: dict[str, Answer] | None = None, **overrides: Any) -> AsyncIterator[Place]:
    """A daemon whose models `openai/NAME...` are each answered by their own local stub."""
    answers = answers or {"stub": lambda messages: f"stub heard: {last_user(messages)}"}
    async with AsyncExitStack() as stack:
        stubs = {name: await stack.enter_async_context(StubOpenAI(answer=answer)) for name, answer in answers.items()}
        models = {f"openai/{name}*": {"api_base": stub.api_base} for name, stub in stubs.items()}
        overrides.setdefault("default_model", f"openai/{next(iter(answers))}-model")
        daemon = await stack.enter_async_context(running_daemon(root, models=models, **overrides))
        yield Place(daemon, stubs, root)


def without_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m for m in messages if m["role"] != "system"]


async def one_conversation_of_two(where: Place) -> tuple[str, list[dict[str, Any]]]:
    """Both `llm` responses belong to one llm conversation and one KSI conversation of two exchanges."""
    logs = await where.logs()
    assert len(logs) == 2
    assert logs[0]["conversation_id"] == logs[1]["conversation_id"]
    ksi_ids = {row["response_json"]["conversation_id"] for row in logs}
    assert ksi_ids == {"llm-" + logs[0]["conversation_id"]}
    ksi_id = ksi_ids.pop()
    index = where.index(ksi_id)
    assert [entry.n for entry in index] == [1, 2]
    assert [entry.response_id for entry in index] == [row["response_json"]["response_id"] for row in logs]
    meta = json.loads(where.daemon.layout.meta_file(ksi_id).read_text())
    assert meta["extra"]["external_ids"] == {"llm": logs[0]["conversation_id"]}
    return ksi_id, logs


def test_plugin_stays_off_the_daemon_and_litellm() -> None:
    probe = ("import sys, ksi_llm.plugin, ksi_llm.model;"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('ksi_daemon', 'litellm')))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# -- continuity ---------------------------------------------------------------------------


async def test_consortium_continues_with_llm_c(short_tmp: Path) -> None:
    answers = {"ma": member("A"), "mb": member("B"), "mc": member("C"), "judge": lambda m: verdict("?")}
    async with place(short_tmp, answers) as where:
        async with connected(where.daemon) as client:
            await client.request("consortium:save", {"name": "trio", "members": ["openai/ma", "openai/mb", "openai/mc"],
                                                     "arbiter": "openai/judge"})
        assert "ksi/consortium/trio" in await where.llm("models")
        where.stubs["judge"].enqueue(verdict("Hello Alice."), verdict("Your name is Alice."))
        assert await where.llm("-m", "ksi/consortium/trio", "My name is Alice") == "Hello Alice.\n"
        assert await where.llm("-c", "What is my name?") == "Your name is Alice.\n"
        ksi_id, logs = await one_conversation_of_two(where)
        shown = await where.llm_logs()
        assert [row["id"] for row in shown] == [row["id"] for row in logs]
        assert [row["prompt"] for row in shown] == ["My name is Alice", "What is my name?"]
        assert {row["conversation_id"] for row in shown} == {logs[0]["conversation_id"]}
        assert [row["response_json"]["conversation_id"] for row in shown] == [ksi_id, ksi_id]
        code, out, err = await where.run("ksi", "conversation", "show", ksi_id)  # the same turns, in KSI
        assert code == 0, err
        transcript = json.loads(out)
        assert [e["response_id"] for e in transcript["exchanges"]] == [r["response_json"]["response_id"] for r in shown]
        assert transcript["conversation"]["external_ids"] == {"llm": logs[0]["conversation_id"]}

    earlier = [{"role": "user", "content": "My name is Alice"}, {"role": "assistant", "content": "Hello Alice."}]
    for name in ("ma", "mb", "mc", "judge"):
        requests = where.stubs[name].requests
        assert len(requests) == 2, name
        assert without_system(requests[1]["messages"])[:2] == earlier, name  # the second run saw the first
    for name in ("ma", "mb", "mc"):
        assert where.stubs[name].requests[1]["messages"][-1] == {"role": "user", "content": "What is my name?"}
    assert all(row["model"] == "ksi/consortium/trio" for row in logs)
    assert all(row["response_json"]["run_id"] for row in logs)


async def test_plain_model_with_system_options_stream_and_usage(short_tmp: Path) -> None:
    async with place(short_tmp) as where:
        out = await where.llm("-m", "ksi/openai/stub-model", "-s", "Be brief", "-o", "temperature", "0.2",
                              "-o", "max_tokens", "50", "My name is Alice")
        assert out == "stub heard: My name is Alice\n"
        assert await where.llm("-c", "--no-stream", "What is my name?") == "stub heard: What is my name?\n"
        ksi_id, logs = await one_conversation_of_two(where)
        stub = where.stubs["stub"]

    first, second = stub.requests
    assert first["stream"] is True and not second.get("stream")
    assert first["temperature"] == 0.2 and first["max_tokens"] == 50
    assert first["messages"] == [{"role": "system", "content": "Be brief"},
                                 {"role": "user", "content": "My name is Alice"}]
    assert second["messages"] == [  # llm sent only the new prompt; KSI rebuilt the rest
        {"role": "system", "content": "Be brief"}, {"role": "user", "content": "My name is Alice"},
        {"role": "assistant", "content": "stub heard: My name is Alice"},
        {"role": "user", "content": "What is my name?"}]
    assert logs[1]["input_tokens"] == 16 and logs[1]["output_tokens"] == 6  # the stub counts words
    assert logs[0]["response_json"]["model"] == "openai/stub-model"


async def test_agent_continues_with_llm_c(short_tmp: Path) -> None:
    async with place(short_tmp) as where:
        async with connected(where.daemon) as client:
            await client.request("agent:spawn", {"agent_id": "alice", "profile": "assistant",
                                                 "model": "openai/stub-model"})
        assert "ksi/agent/alice" in await where.llm("models")
        await where.llm("-m", "ksi/agent/alice", "My name is Alice")
        await where.llm("-c", "What is my name?")
        ksi_id, _logs = await one_conversation_of_two(where)
        index = where.index(ksi_id)
        stub = where.stubs["stub"]

    assert {entry.agent_id for entry in index} == {"alice"}
    first, second = stub.requests
    assert first["messages"][0]["role"] == "system"  # the agent's profile speaks
    assert without_system(second["messages"]) == [
        {"role": "user", "content": "My name is Alice"}, {"role": "assistant", "content": "stub heard: My name is Alice"},
        {"role": "user", "content": "What is my name?"}]


async def test_llm_chat_three_turns_in_a_terminal(short_tmp: Path) -> None:
    async with place(short_tmp) as where:
        def chat() -> None:
            child = pexpect.spawn(str(BIN / "llm"), ["chat", "-m", "ksi/echo/demo"], cwd=str(where.root),
                                  env=where.env(), encoding="utf-8", timeout=TIMEOUT)
            try:
                for n, line in enumerate(["My name is Alice", "I live in Paris", "Who am I?"]):
                    child.expect("> ")
                    child.sendline(line)
                    child.expect(f"Messages received: {2 * n + 1}")
                child.expect("> ")
                child.sendline("exit")
                child.expect(pexpect.EOF)
            finally:
                child.close()

        await asyncio.to_thread(chat)
        logs = await where.logs()
        ksi_id = logs[0]["response_json"]["conversation_id"]
        index = where.index(ksi_id)

    assert len(logs) == 3 and len({row["conversation_id"] for row in logs}) == 1
    assert [entry.n for entry in index] == [1, 2, 3]
    assert [row["response_json"]["conversation_id"] for row in logs] == [ksi_id] * 3


async def test_llm_then_ksi_ask_then_llm_c(short_tmp: Path) -> None:
    async with place(short_tmp) as where:
        # a model the daemon does not list: named on the command line, then found in llm's log by `llm -c`
        assert "stub-other" not in await where.llm("models")
        await where.llm("-m", "ksi/openai/stub-other", "My name is Alice")
        ksi_id = (await where.logs())[0]["response_json"]["conversation_id"]
        code, out, err = await where.run("ksi", "ask", "--cid", ksi_id, "I live in Paris")
        assert code == 0, err
        await where.llm("-c", "Where do I live?")
        index = where.index(ksi_id)
        stub = where.stubs["stub"]
        meta = json.loads(where.daemon.settings.layout.meta_file(ksi_id).read_text())

    assert (meta["origin"], meta["preview"]) == ("llm", "My name is Alice")  # made by llm, continued by ksi ask

    assert [entry.n for entry in index] == [1, 2, 3]
    assert [request["model"] for request in stub.requests] == ["stub-other"] * 3
    assert stub.requests[-1]["messages"] == [
        {"role": "user", "content": "My name is Alice"}, {"role": "assistant", "content": "stub heard: My name is Alice"},
        {"role": "user", "content": "I live in Paris"}, {"role": "assistant", "content": "stub heard: I live in Paris"},
        {"role": "user", "content": "Where do I live?"}]


# -- bad input ----------------------------------------------------------------------------


async def test_daemon_down_is_a_clear_llm_error(short_tmp: Path) -> None:
    async with place(short_tmp) as where:
        async with connected(where.daemon) as client:
            await client.request("consortium:save", {"name": "trio", "members": ["openai/stub-a"],
                                                     "arbiter": "openai/stub-judge"})
        await where.llm("-m", "ksi/echo/demo", "My name is Alice")
        ksi_id = (await where.logs())[0]["response_json"]["conversation_id"]
    # the daemon is gone: the models it offered are still listed, from the cache
    assert "ksi/consortium/trio" in await where.llm("models")
    code, out, err = await where.run("llm", "-c", "What is my name?")
    assert code != 0 and out == ""
    assert "[daemon_unreachable]" in err and "ksi daemon start" in err
    assert len(await where.logs()) == 1  # nothing recorded as a success
    assert [entry.n for entry in where.index(ksi_id)] == [1]

    # never reached with this llm user directory: no cache, and still the same clear error
    code, out, err = await where.run("llm", "-m", "ksi/echo/demo", "hello", socket=short_tmp / "none.sock")
    assert code != 0 and "[daemon_unreachable]" in err


async def test_unknown_consortium_gets_ksi_code(short_tmp: Path) -> None:
    async with place(short_tmp) as where:
        code, out, err = await where.run("llm", "-m", "ksi/consortium/nope", "hello")
        assert code != 0 and "[consortium_not_found]" in err and "consortium:list" in err
        assert await where.logs() == []
        assert not any(where.daemon.layout.conversations_dir.glob("*.jsonl"))
        assert not any(where.daemon.layout.conversation_meta_dir.glob("*.json"))


async def test_expired_conversation_behind_llm_c(short_tmp: Path) -> None:
    async with place(short_tmp) as where:
        await where.llm("-m", "ksi/echo/demo", "My name is Alice")
        ksi_id = (await where.logs())[0]["response_json"]["conversation_id"]
        async with connected(where.daemon) as client:
            await client.request("conversation:update", {"conversation_id": ksi_id, "ttl": 0.001})
        await asyncio.sleep(0.01)
        code, out, err = await where.run("llm", "-c", "What is my name?")
        assert code != 0 and "[conversation_expired]" in err and f"ksi conversation show {ksi_id}" in err
        assert len(await where.logs()) == 1
        assert [entry.n for entry in where.index(ksi_id)] == [1]


async def test_provider_error_mid_conversation(short_tmp: Path) -> None:
    async with place(short_tmp) as where:
        await where.llm("-m", "ksi/openai/stub-model", "My name is Alice")
        ksi_id = (await where.logs())[0]["response_json"]["conversation_id"]
        where.stubs["stub"].enqueue(Reply(status=400))  # refused: not worth a retry
        code, out, err = await where.run("llm", "-c", "What is my name?")
        assert code != 0 and "[provider_error]" in err
        assert len(await where.logs()) == 1
        assert [entry.n for entry in where.index(ksi_id)] == [1]  # a failed request is never indexed


async def test_async_llm_continues_too(short_tmp: Path) -> None:
    async with place(short_tmp) as where:
        assert await where.llm("--async", "-m", "ksi/openai/stub-model", "My name is Alice") == \
            "stub heard: My name is Alice\n"
        await where.llm("--async", "-c", "--no-stream", "What is my name?")
        ksi_id, logs = await one_conversation_of_two(where)
        stub = where.stubs["stub"]

    assert stub.requests[0]["stream"] is True
    assert stub.requests[1]["messages"][-3:] == [
        {"role": "user", "content": "My name is Alice"}, {"role": "assistant", "content": "stub heard: My name is Alice"},
        {"role": "user", "content": "What is my name?"}]
    assert logs[1]["input_tokens"] == 14


async def test_attachments_are_ksi_files(short_tmp: Path) -> None:
    allowed = short_tmp / "files"
    allowed.mkdir()
    (allowed / "note.txt").write_text("The secret word is heron.\n")
    (short_tmp / "elsewhere.txt").write_text("not for the model\n")
    async with place(short_tmp, allowed_file_roots=[allowed]) as where:
        await where.llm("-m", "ksi/openai/stub-model", "-a", "files/note.txt", "What is the secret word?")
        code, out, err = await where.run("llm", "-c", "-a", "elsewhere.txt", "And this?")
        assert code != 0 and "[path_not_allowed]" in err
        logs = await where.logs()
        stub = where.stubs["stub"]
        index = where.index(logs[0]["response_json"]["conversation_id"])

    assert len(logs) == 1 and [entry.n for entry in index] == [1]
    assert len(stub.requests) == 1
    assert "The secret word is heron." in stub.requests[0]["messages"][-1]["content"]


async def test_full_conversation_behind_llm_c(short_tmp: Path) -> None:
    async with place(short_tmp) as where:
        await where.llm("-m", "ksi/echo/demo", "My name is Alice")
        ksi_id = (await where.logs())[0]["response_json"]["conversation_id"]
        async with connected(where.daemon) as client:
            await client.request("conversation:update", {"conversation_id": ksi_id, "turn_cap": 1})
        code, out, err = await where.run("llm", "-c", "What is my name?")
        assert code != 0 and "[conversation_full]" in err
        assert len(await where.logs()) == 1
        assert [entry.n for entry in where.index(ksi_id)] == [1]


def test_a_var_dir_that_is_a_file_leaves_llm_working_without_ksi_models(short_tmp: Path) -> None:
    (short_tmp / "not-a-dir").write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith(PROVIDER_PREFIXES)}
    env.update(LLM_USER_PATH=str(short_tmp / "llm"), KSI_VAR_DIR=str(short_tmp / "not-a-dir"))
    listed = subprocess.run([str(BIN / "llm"), "models"], cwd=short_tmp, env=env, capture_output=True, text=True,
                            timeout=TIMEOUT)
    assert listed.returncode == 0, listed.stderr
    assert "Traceback" not in listed.stderr and "ksi/" not in listed.stdout
