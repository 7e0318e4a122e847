"""Inspection commands (`ksi conversations`, `ksi conversation show|export`, `ksi response show`,
`ksi logs`) run as real processes on a var dir whose daemon is stopped, torn lines included."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from ksi_common.errors import KsiError
from tests.conftest import complete, connected, running_daemon, stub_settings
from tests.stub_openai import Reply

pytestmark = pytest.mark.backends

TIMEOUT = 30.0


def ksi(*args: str, cwd: Path, tty: bool = False, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    # a width inherited from the runner (a parallel test worker sets one) must not decide the layout
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("KSI_", "OPENAI_")) and k != "COLUMNS"}
    env = {**inherited, **(env or {})}
    if not tty:
        return subprocess.run([sys.executable, "-m", "ksi_cli", *args], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    # a pseudo-terminal on stdout: the pretty output a person sees
    leader, follower = os.openpty()
    try:
        process = subprocess.run([sys.executable, "-m", "ksi_cli", *args], cwd=cwd, env={"COLUMNS": "160", **env},
                                 stdout=follower, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                 timeout=TIMEOUT, text=True)
        os.close(follower)
        follower = -1
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        return subprocess.CompletedProcess(process.args, process.returncode, b"".join(chunks).decode(), process.stderr)
    finally:
        if follower >= 0:
            os.close(follower)
        os.close(leader)


def as_json(result: subprocess.CompletedProcess[str]) -> Any:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


async def fill(short_tmp: Path, stub: Any, backend: dict[str, Any]) -> dict[str, Any]:
    """A var dir (and a database, with postgres) written by a real daemon, which is stopped before
    the test looks at it; `env` is what tells the `ksi` commands where to read."""
    root = short_tmp / "files"
    root.mkdir()
    (root / "notes.txt").write_text("some notes")
    env = {"KSI_STORAGE": "postgres", "KSI_DATABASE_URL": backend["database_url"]} if backend else {}
    made: dict[str, Any] = {"root": short_tmp, "var": short_tmp / "var", "env": env}
    async with running_daemon(short_tmp, allowed_file_roots=[root], **stub_settings(stub), **backend) as daemon, \
            connected(daemon) as client:
        made["first"] = await complete(client, prompt="first question", conversation_id="main", create=True,
                                       files=[str(root / "notes.txt")])
        made["second"] = await complete(client, model="echo/x", prompt="second question", conversation_id="main")
        await client.request("conversation:update", {"conversation_id": "main", "title": "Main talk", "tags": ["demo"]})
        stub.enqueue(Reply(status=400))
        failed = await client.request("completion:async", {"prompt": "this fails", "conversation_id": "main",
                                                            "model": "openai/stub-model"})
        with pytest.raises(KsiError):
            await client.request("completion:wait", {"request_id": failed["request_id"], "timeout": 30})
        made["failed"] = (await client.request("completion:status", {"request_id": failed["request_id"]}))["response_id"]
        await client.request("conversation:fork", {"conversation_id": "main", "at": 1, "new_id": "branch"})
        made["branch"] = await complete(client, prompt="branching out", conversation_id="branch")
        made["exports"] = {fmt: (await client.request("conversation:export",
                                                      {"conversation_id": "branch", "format": fmt}))["content"]
                           for fmt in ("markdown", "json", "jsonl")}
        made["show"] = await client.request("conversation:show", {"conversation_id": "branch"})
        made["list"] = await client.request("conversation:list", {})
    assert not (made["var"] / "run" / "daemon.pid").exists()  # the daemon is gone
    return made


@pytest.fixture
async def filled(short_tmp: Path, stub: Any, backend: dict[str, Any]) -> dict[str, Any]:
    return await fill(short_tmp, stub, backend)


@pytest.fixture
async def filled_files(short_tmp: Path, stub: Any) -> dict[str, Any]:
    """`filled`, always in files: for what only files can suffer (a torn last line)."""
    return await fill(short_tmp, stub, {})


async def test_agents_are_read_where_the_daemon_keeps_them_once_it_is_stopped(short_tmp: Path,
                                                                               backend: dict[str, Any]) -> None:
    env = {"KSI_STORAGE": "postgres", "KSI_DATABASE_URL": backend["database_url"]} if backend else {}
    async with running_daemon(short_tmp, **backend) as daemon, connected(daemon) as client:
        await client.request("agent:spawn", {"agent_id": "scribe", "model": "echo/s"})
        await client.request("agent:send_message", {"agent_id": "scribe", "message": "take a note", "wait": 30})
        await client.request("agent:spawn", {"agent_id": "idle", "model": "echo/i"})
        await client.request("agent:terminate", {"agent_id": "idle"})
        online = await client.request("agent:list", {})
    where = ["--var-dir", str(short_tmp / "var")]
    offline = ksi("agents", "--json", *where, cwd=short_tmp, env=env)
    assert "daemon not running" in offline.stderr
    assert ("database" in offline.stderr) == bool(backend)
    fields = ("agent_id", "conversation_id", "status", "exchanges", "created", "last_activity")
    listed = [{k: a[k] for k in fields} for a in as_json(offline)["agents"]]
    assert listed == [{k: a[k] for k in fields} for a in online["agents"]]
    assert [(a["agent_id"], a["status"], a["exchanges"]) for a in listed] == [("scribe", "active", 1),
                                                                              ("idle", "terminated", 0)]
    active = as_json(ksi("agents", "--json", "--status", "active", *where, cwd=short_tmp, env=env))
    assert [a["agent_id"] for a in active["agents"]] == ["scribe"]


async def test_inspection_reads_var_with_the_daemon_stopped(filled: dict[str, Any]) -> None:
    where = ["--var-dir", str(filled["var"])]
    cwd = filled["root"]

    listed = as_json(ksi("conversations", *where, cwd=cwd, env=filled["env"]))
    assert [c["conversation_id"] for c in listed["conversations"]] == ["branch", "main"]
    assert listed == filled["list"] | {"conversations": listed["conversations"]}
    def ids(*filters: str) -> list[str]:
        return [c["conversation_id"] for c in as_json(ksi("conversations", *where, *filters, cwd=cwd, env=filled["env"]))["conversations"]]

    assert ids("--tag", "demo") == ["branch", "main"]  # a fork inherits its parent's tags
    assert ids("--model", "echo/*") == ["main"]
    assert ids("--search", "BRANCHING") == ["branch"]
    assert ids("--limit", "1", "--offset", "1") == ["main"]

    shown = as_json(ksi("conversation", "show", "branch", *where, cwd=cwd, env=filled["env"]))
    assert shown["exchanges"] == filled["show"]["exchanges"]
    assert [(x["n"], x["inherited"]) for x in shown["exchanges"]] == [(1, True), (2, False)]
    assert shown["exchanges"][0]["inputs"][0]["files"][0]["path"].endswith("notes.txt")

    # one renderer: the CLI's export is the daemon's export
    for fmt, content in filled["exports"].items():
        result = ksi("conversation", "export", "branch", "--format", fmt, *where, cwd=cwd, env=filled["env"])
        assert result.returncode == 0, result.stderr
        assert result.stdout == content, fmt

    response = as_json(ksi("response", "show", filled["first"]["response_id"], *where, cwd=cwd, env=filled["env"]))
    assert response["inputs"][0]["content"] == "first question"
    assert response["outcome"]["content"] == filled["first"]["content"]
    failed = as_json(ksi("response", "show", filled["failed"], *where, cwd=cwd, env=filled["env"]))
    assert failed["outcome"]["type"] == "error" and failed["outcome"]["code"] == "provider_error"

    for args, code in ((("conversation", "show", "nope"), "conversation_not_found"),
                       (("conversation", "show", "../x"), "validation_error"),
                       (("response", "show", "nope-123"), "response_not_found")):
        result = ksi(*args, *where, cwd=cwd, env=filled["env"])
        assert result.returncode == 1
        assert json.loads(result.stderr)["error"]["code"] == code


async def test_pretty_output_on_a_terminal(filled: dict[str, Any]) -> None:
    where = ["--var-dir", str(filled["var"])]
    table = ksi("conversations", *where, cwd=filled["root"], tty=True, env=filled["env"])
    assert table.returncode == 0, table.stderr
    assert "Main talk" in table.stdout and "branch" in table.stdout and "openai/stub-model" in table.stdout
    assert not table.stdout.lstrip().startswith("{")
    shown = ksi("conversation", "show", "main", *where, cwd=filled["root"], tty=True, env=filled["env"])
    plain = re.sub(r"\x1b\[[0-9;]*m", "", shown.stdout)
    assert "Main talk" in plain and "user: second question" in plain
    assert "# Main talk" not in plain  # lines to read, not Markdown source (the export gives that)
    forced = ksi("conversations", *where, "--json", cwd=filled["root"], tty=True, env=filled["env"])
    assert json.loads(forced.stdout)["total"] == 2


async def test_torn_last_lines_are_skipped(filled_files: dict[str, Any]) -> None:
    filled = filled_files
    var: Path = filled["var"]
    where = ["--var-dir", str(var)]
    index = var / "logs" / "conversations" / "main.jsonl"
    with open(index, "ab") as handle:  # a crash in the middle of appending exchange 3
        handle.write(b'{"v": 1, "n": 3, "response_id": "openai-stub-model-0000')
    response = var / "logs" / "responses" / f"{filled['second']['response_id']}.jsonl"
    data = response.read_bytes()
    response.write_bytes(data[: data.rindex(b"\n", 0, len(data) - 1) + 1] + b'{"v": 1, "type": "assist')

    shown = as_json(ksi("conversation", "show", "main", *where, cwd=filled["root"]))
    assert [x["n"] for x in shown["exchanges"]] == [1, 2]
    assert shown["exchanges"][1]["incomplete"] is True and shown["exchanges"][1]["reply"] is None
    assert shown["exchanges"][1]["inputs"][0]["content"] == "second question"
    markdown = ksi("conversation", "export", "main", "--format", "markdown", *where, cwd=filled["root"])
    assert markdown.returncode == 0 and "no reply recorded" in markdown.stdout
    torn = as_json(ksi("response", "show", filled["second"]["response_id"], *where, cwd=filled["root"]))
    assert torn["outcome"] is None and torn["inputs"][0]["content"] == "second question"
    listed = as_json(ksi("conversations", *where, "--search", "second question", cwd=filled["root"]))
    assert [c["conversation_id"] for c in listed["conversations"]] == ["main"]
    stats = as_json(ksi("conversation", "show", "branch", *where, cwd=filled["root"]))
    assert len(stats["exchanges"]) == 2


def write_log(path: Path, records: list[dict[str, Any] | str], torn: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("".join(line + "\n" for line in lines) + torn)


def test_logs_filter_render_and_follow(short_tmp: Path) -> None:
    var = short_tmp / "var"
    log = var / "logs" / "daemon" / "daemon.log"
    write_log(log, [
        {"event": "daemon_started", "level": "info", "timestamp": "2026-01-01T00:00:00Z", "pid": 7},
        {"event": "listener_failed", "level": "error", "timestamp": "2026-01-01T00:00:01Z", "event_name": "x"},
        {"event": "slow_subscriber", "level": "warning", "timestamp": "2026-01-01T00:00:02Z"},
        "a stray non-JSON line",
    ], torn='{"event": "half a li')
    where = ["--var-dir", str(var)]

    everything = ksi("logs", *where, cwd=short_tmp)
    records = [json.loads(line) for line in everything.stdout.splitlines()]
    assert [r["event"] for r in records] == ["daemon_started", "listener_failed", "slow_subscriber",
                                             "a stray non-JSON line"]
    warnings = ksi("logs", *where, "--level", "warning", cwd=short_tmp)
    assert [json.loads(line)["event"] for line in warnings.stdout.splitlines()] == ["listener_failed", "slow_subscriber"]
    grep = ksi("logs", *where, "--grep", "SUBSCRIBER", cwd=short_tmp)
    assert [json.loads(line)["event"] for line in grep.stdout.splitlines()] == ["slow_subscriber"]
    pretty = ksi("logs", *where, "--level", "error", cwd=short_tmp, tty=True)
    assert "2026-01-01T00:00:01Z ERROR" in pretty.stdout and "listener_failed event_name=x" in pretty.stdout
    missing = ksi("logs", "--var-dir", str(short_tmp / "nowhere"), cwd=short_tmp)
    assert missing.returncode == 1

    env = {k: v for k, v in os.environ.items() if not k.startswith("KSI_")}
    follower = subprocess.Popen([sys.executable, "-m", "ksi_cli", "logs", *where, "--follow", "--grep", "later",
                                 "-n", "0"], cwd=short_tmp, env=env, stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(1.0)  # let it reach the end of the file
        with open(log, "a") as handle:
            handle.write('ne"}\n')  # completes the torn line: it does not match, so it is not shown
            handle.write(json.dumps({"event": "later_event", "level": "info", "timestamp": "t"}) + "\n")
        assert follower.stdout is not None
        line = follower.stdout.readline()
        assert json.loads(line)["event"] == "later_event"
    finally:
        follower.terminate()
        follower.wait(timeout=10)


def test_hand_written_var_with_legacy_lines_and_agents(short_tmp: Path) -> None:
    var = short_tmp / "var"
    responses, conversations, metas = (var / "logs" / "responses", var / "logs" / "conversations",
                                       var / "state" / "conversations")
    for directory in (responses, conversations, metas):
        directory.mkdir(parents=True)
    for rid, question in (("legacy-000000000001", "old question"), ("m-000000000002", "agent question")):
        lines = [{"type": "user", "content": question, "conversation_id": "x"},
                 {"type": "assistant", "content": f"answer to {question}", "model": "m"}]
        (responses / f"{rid}.jsonl").write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    # conversation "old": a bare-id legacy index and no metadata; "owned": an agent's own conversation;
    # "visited": another agent answered in it (only its index says so)
    (conversations / "old.jsonl").write_text("legacy-000000000001\n")
    (metas / "owned.json").write_bytes(orjson.dumps({"conversation_id": "owned", "agent_id": "alpha",
                                                     "last_activity": "2026-01-02T00:00:00Z"}))
    (conversations / "visited.jsonl").write_bytes(orjson.dumps(
        {"v": 1, "n": 1, "response_id": "m-000000000002", "model": "m", "agent_id": "beta",
         "ts": "2026-01-03T00:00:00Z"}) + b"\n")
    where = ["--var-dir", str(var)]

    listed = as_json(ksi("conversations", *where, cwd=short_tmp))
    assert [c["conversation_id"] for c in listed["conversations"]] == ["visited", "owned", "old"]
    assert {c["conversation_id"]: c["exchanges"] for c in listed["conversations"]} == {"visited": 1, "owned": 0, "old": 1}
    for agent, expected in (("alpha", ["owned"]), ("beta", ["visited"]), ("gamma", [])):
        found = as_json(ksi("conversations", *where, "--agent", agent, cwd=short_tmp))
        assert [c["conversation_id"] for c in found["conversations"]] == expected
    shown = as_json(ksi("conversation", "show", "old", *where, cwd=short_tmp))
    assert [(x["n"], x["inputs"][0]["content"], x["reply"]["content"]) for x in shown["exchanges"]] == [
        (1, "old question", "answer to old question")]
