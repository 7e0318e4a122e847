"""Everything under the var dir is owner-only (directories 0700, files 0600) whatever the umask,
and `ksi doctor --repair` tightens what an older daemon or a careless hand left open."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from click.testing import CliRunner

from ksi_cli.main import cli
from ksi_common.privacy import loose_modes
from tests.conftest import complete, connected, running_daemon


@contextmanager
def umask(value: int) -> Iterator[None]:
    old = os.umask(value)
    try:
        yield
    finally:
        os.umask(old)


def loose(root: Path) -> list[str]:
    return [f"{path.relative_to(root)} {mode:04o}" for path, mode, _wanted in loose_modes(root)]


async def test_the_daemon_creates_nothing_others_may_read(short_tmp: Path) -> None:
    with umask(0):
        async with running_daemon(short_tmp, socket_path=None) as daemon, connected(daemon) as client:
            first = await complete(client, prompt="hello", model="echo/x", conversation_id="c", create=True)
            await client.request("conversation:fork", {"conversation_id": "c", "new_id": "f"})
            exported = await client.request("conversation:export", {"conversation_id": "c", "format": "json"})
            await client.request("conversation:import", {"data": exported["content"], "new_id": "imp"})
            await client.request("agent:spawn", {"agent_id": "a", "model": "echo/x", "prompt": "hi"})
            await complete(client, prompt="again", agent_id="a")
            await client.request("agent:reset", {"agent_id": "a"})
            await client.request("consortium:save", {"name": "pair", "members": ["echo/a", "echo/b"],
                                                     "arbiter": "echo/c"})
            assert first["response_id"]
            root = daemon.layout.root
            assert loose(root) == []
            assert stat.S_IMODE(daemon.layout.lock_file.stat().st_mode) == 0o600
        assert loose(root) == []


def test_a_daemon_started_by_the_cli_keeps_its_files_private(short_tmp: Path) -> None:
    ksi = [sys.executable, "-m", "ksi_cli"]
    where = ["--var-dir", str(short_tmp / "var"), "--socket", str(short_tmp / "d.sock")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KSI_")}
    env["KSI_LITELLM_PRELOAD"] = "false"

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*ksi, *args], env=env, capture_output=True, text=True, timeout=60,
                              preexec_fn=lambda: os.umask(0o022))

    started = run("daemon", "start", *where)
    assert started.returncode == 0, started.stderr
    try:
        sent = run("send", *where, "--wait", "completion:async", "--prompt", "hi", "--model", "echo/x")
        assert sent.returncode == 0, sent.stderr
        asked = run("ask", *where, "--model", "echo/x", "second question")
        assert asked.returncode == 0, asked.stderr
        assert (short_tmp / "var" / "logs" / "daemon" / "stderr.log").exists()
        assert loose(short_tmp / "var") == []
    finally:
        run("daemon", "stop", *where)
    assert loose(short_tmp / "var") == []


def test_doctor_repair_tightens_modes_and_follows_no_link(short_tmp: Path) -> None:
    var = short_tmp / "var"
    with umask(0o022):
        (var / "logs" / "conversations").mkdir(parents=True)
        (var / "run").mkdir(mode=0o700)
        index = var / "logs" / "conversations" / "c.jsonl"
        index.write_text("")
        outside = short_tmp / "outside.txt"
        outside.write_text("not ours")
        (var / "logs" / "link.txt").symlink_to(outside)
    (var / "run").chmod(0o700)
    result = CliRunner().invoke(cli, ["doctor", "--json", "--var-dir", str(var)])
    report = json.loads(result.output)
    found = sorted(Path(p["path"]).name for p in report["problems"] if p["kind"] == "loose_permissions")
    assert found == ["c.jsonl", "conversations", "logs", "var"]
    assert result.exit_code == 1
    result = CliRunner().invoke(cli, ["doctor", "--json", "--repair", "--var-dir", str(var)])
    report = json.loads(result.output)
    # what is left is the link: reported, never repaired (see test_var_links.py)
    assert [(p["kind"], Path(p["path"]).name) for p in report["problems"]] == [("var_link", "link.txt")]
    assert result.exit_code == 1, result.output
    assert sorted(Path(r["path"]).name for r in report["repaired"]) == ["c.jsonl", "conversations", "logs", "var"]
    assert stat.S_IMODE(index.stat().st_mode) == 0o600
    assert stat.S_IMODE((var / "logs").stat().st_mode) == 0o700
    assert stat.S_IMODE(outside.stat().st_mode) == 0o644  # the link's target is not ours
