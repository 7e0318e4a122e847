"""Everyday commands as real `ksi` processes: monitor, models, agents offline, logs -n 0, colour."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from ksi_common.client import KsiClient
from tests.conftest import complete, running_daemon
from tests.test_cli_ask import clean_env, ksi, ksi_on_terminal, where


async def read_line(stream: asyncio.StreamReader) -> str:
    return (await asyncio.wait_for(stream.readline(), 30)).decode()


async def test_monitor_filters_follows_restarts_and_prints_json_lines(short_tmp: Path) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "ksi_cli", "monitor", "--namespace", "completion", "--conversation", "conv-seen",
        *where(short_tmp), cwd=short_tmp, env=clean_env(), stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    assert process.stdout is not None and process.stderr is not None
    try:
        for round_ in range(2):  # the second round is a new daemon on the same socket
            async with running_daemon(short_tmp) as daemon, KsiClient(daemon.settings.socket) as client:
                while daemon.monitor.count() == 0:
                    await asyncio.sleep(0.05)
                await complete(client, prompt="unseen", conversation_id="conv-other", create=True)
                await complete(client, prompt=f"seen {round_}", conversation_id="conv-seen", create=True,
                               model="echo/m")
                line = json.loads(await read_line(process.stdout))
                while line["event"] != "completion:result":
                    assert line["data"]["conversation_id"] == "conv-seen"
                    line = json.loads(await read_line(process.stdout))
                assert line["data"]["content"].startswith(f"You said: seen {round_}")
        # the restart was announced on stderr, not mixed into the JSON lines
        assert "reconnecting" in (await read_line(process.stderr)) + (await read_line(process.stderr))
    finally:
        process.terminate()
        await process.wait()


async def test_monitor_on_a_terminal_is_one_readable_line_per_event(short_tmp: Path) -> None:
    async with running_daemon(short_tmp) as daemon, KsiClient(daemon.settings.socket) as client:
        master, slave = __import__("os").openpty()
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "ksi_cli", "monitor", "-e", "completion:result", *where(short_tmp),
            cwd=short_tmp, env=clean_env(), stdin=asyncio.subprocess.DEVNULL, stdout=slave,
            stderr=asyncio.subprocess.PIPE)
        import os
        os.close(slave)
        try:
            while daemon.monitor.count() == 0:
                await asyncio.sleep(0.05)
            await complete(client, prompt="show me", model="echo/t")
            text = ""
            while "completion:result" not in text or "\n" not in text.split("completion:result", 1)[1]:
                text += (await asyncio.to_thread(os.read, master, 4096)).decode()
        finally:
            process.terminate()
            await process.wait()
            os.close(master)
    line = next(line for line in text.splitlines() if "completion:result" in line)
    assert "model=echo/t" in line and "content=You said: show me" in line
    assert not line.lstrip().startswith("{")


async def test_models_lists_default_configured_builtins_consortia_and_litellm(short_tmp: Path) -> None:
    async with running_daemon(short_tmp, models={"openai/local*": {"api_base": "http://127.0.0.1:1/v1"}}) as daemon, \
            KsiClient(daemon.settings.socket) as client:
        await client.request("consortium:save", {"name": "pair", "members": ["echo/a", "echo/b"], "arbiter": "echo/j"})
        run = await ksi(short_tmp, "models", "--json", *where(short_tmp))
        assert run.code == 0, run.err
        listing = run.json()
        assert listing["default_model"] == "echo/default"
        assert listing["configured"]["openai/local*"]["api_base"] == "http://127.0.0.1:1/v1"
        assert "echo/*" in listing["built_in"] and "consortium/pair" in listing["consortia"]
        assert listing["litellm_count"] > 100
        found = await ksi(short_tmp, "models", "--json", "gpt-4o-mini", *where(short_tmp))
        assert found.code == 0 and "gpt-4o-mini" in found.json()["litellm"]
    # with the daemon stopped, what a start would use, and the saved consortia from disk
    offline = await ksi(short_tmp, "models", "--json", *where(short_tmp))
    assert offline.code == 0, offline.err
    assert "consortium/pair" in offline.json()["consortia"]


async def test_agents_with_the_daemon_stopped(short_tmp: Path) -> None:
    async with running_daemon(short_tmp) as daemon, KsiClient(daemon.settings.socket) as client:
        await client.request("agent:spawn", {"agent_id": "kept", "model": "echo/k"})
        await client.request("agent:send_message", {"agent_id": "kept", "message": "hello", "wait": 30})
        online = await ksi(short_tmp, "agents", "--json", *where(short_tmp))
    offline = await ksi(short_tmp, "agents", "--json", *where(short_tmp))
    assert offline.code == 0, offline.err
    assert "daemon not running" in offline.err
    (agent,) = offline.json()["agents"]
    assert (agent["agent_id"], agent["status"], agent["exchanges"]) == ("kept", "active", 1)
    assert agent["agent_id"] == online.json()["agents"][0]["agent_id"]


async def test_logs_n_0_prints_nothing_and_no_color_is_honoured(short_tmp: Path) -> None:
    log = short_tmp / "var" / "logs" / "daemon" / "daemon.log"
    log.parent.mkdir(parents=True)
    log.write_text(json.dumps({"event": "something_failed", "level": "warning", "timestamp": "2026-01-01T00:00:00Z"})
                   + "\n")
    none = await ksi(short_tmp, "logs", "-n", "0", "--var-dir", str(short_tmp / "var"))
    assert (none.code, none.out) == (0, "")
    some = await ksi(short_tmp, "logs", "-n", "1", "--json", "--var-dir", str(short_tmp / "var"))
    assert json.loads(some.out)["event"] == "something_failed"
    coloured = await ksi_on_terminal(short_tmp, "logs", "--var-dir", str(short_tmp / "var"))
    assert "\x1b[" in coloured.out
    plain = await ksi_on_terminal(short_tmp, "--no-color", "logs", "--var-dir", str(short_tmp / "var"))
    assert "something_failed" in plain.out and "\x1b[" not in plain.out
    table = await ksi_on_terminal(short_tmp, "--no-color", "conversations", "--var-dir", str(short_tmp / "var"))
    assert "\x1b[" not in table.out


@pytest.mark.parametrize("command", [["agents"], ["conversations"], ["conversation", "show", "c-1"],
                                     ["response", "show", "r-1"]])
async def test_reading_a_database_that_cannot_be_read_is_a_clear_error(short_tmp: Path, pg_url: str,
                                                                       command: list[str]) -> None:
    """With the daemon stopped, the inspection commands read the database KSI_STORAGE names: a
    missing URL, an unreachable server and a database no daemon has set up are errors by code
    (exit 1), never a traceback, the password never shown."""
    def run(**env: str) -> Any:
        return ksi(short_tmp, *command, "--json", "--var-dir", str(short_tmp / "var"), env=env)

    unset = await run(KSI_STORAGE="postgres")
    assert unset.code == 1 and json.loads(unset.err)["error"]["code"] == "validation_error", unset.err
    assert "KSI_DATABASE_URL" in unset.err
    away = await run(KSI_STORAGE="postgres", KSI_DATABASE_URL="postgresql://ksi:hunter2@127.0.0.1:1/ksi")
    assert away.code == 1 and json.loads(away.err)["error"]["code"] == "storage_unavailable", away.err
    assert "hunter2" not in away.out + away.err
    empty = await run(KSI_STORAGE="postgres", KSI_DATABASE_URL=pg_url)  # no schema: no daemon ever used it
    assert empty.code == 1 and json.loads(empty.err)["error"]["code"] == "storage_error", empty.err
    assert "Traceback" not in unset.err + away.err + empty.err
