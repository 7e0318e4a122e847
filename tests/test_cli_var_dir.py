"""One daemon found from anywhere: `ksi` run from any directory finds the same var dir.

A real `ksi daemon start` (a subprocess daemon) in a project directory, then commands run from
below it, beside it and with the per-user fallback, each a real `ksi` process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ksi_common.layout import MARKER_NAME
from tests.test_cli import TIMEOUT, clean_env, force_stop, started_pid


def ksi(cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ksi_cli", *args], cwd=cwd, env=clean_env(**env),
                          capture_output=True, text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def project() -> Iterator[Path]:
    """ROOT/proj with a daemon started there by `ksi daemon start --var-dir var`."""
    root = Path(tempfile.mkdtemp(prefix="ksi-", dir="/tmp"))
    proj = root / "proj"
    (proj / "src" / "deep").mkdir(parents=True)
    (root / "elsewhere").mkdir()
    pid = None
    try:
        result = ksi(proj, "daemon", "start", "--var-dir", "var", KSI_LINE_LIMIT="4242",
                     XDG_STATE_HOME=str(root / "state"))
        pid = started_pid(result)
        yield proj
    finally:
        ksi(proj, "daemon", "stop")
        force_stop(pid)
        shutil.rmtree(root, ignore_errors=True)


def test_start_marks_the_var_dir_and_a_second_start_is_a_success(project: Path) -> None:
    assert (project / "var" / MARKER_NAME).is_file()
    assert oct((project / "var").stat().st_mode & 0o777) == oct(0o700)
    again = ksi(project / "src", "daemon", "start", KSI_LINE_LIMIT="4242")  # the settings it runs with
    assert again.returncode == 0, again.stderr
    assert "already running" in again.stdout
    assert str(project / "var") in again.stdout


def test_commands_below_the_project_find_its_daemon(project: Path) -> None:
    deep = project / "src" / "deep"
    status = ksi(deep, "daemon", "status", "--json")
    assert status.returncode == 0, status.stderr
    info = json.loads(status.stdout)
    assert Path(info["var_dir"]) == project / "var"
    assert "project var dir" in info["var_dir_found_by"]
    asked = ksi(deep, "ask", "--model", "echo/demo", "--json", "remember me")
    assert asked.returncode == 0, asked.stderr
    conversation_id = json.loads(asked.stdout)["conversation_id"]
    listed = ksi(project / "src", "conversations", "--json")
    assert listed.returncode == 0, listed.stderr
    assert conversation_id in [c["conversation_id"] for c in json.loads(listed.stdout)["conversations"]]
    assert (project / "var" / "logs" / "conversations" / f"{conversation_id}.jsonl").is_file()


def test_config_shows_the_running_daemons_settings(project: Path) -> None:
    # the daemon was started with KSI_LINE_LIMIT=4242; this process's environment does not say so
    shown = ksi(project / "src", "config", "--json")
    assert shown.returncode == 0, shown.stderr
    view = json.loads(shown.stdout)
    assert view["line_limit"] == 4242
    assert view["settings_source"] == "the running daemon"
    assert Path(view["var_dir"]) == project / "var"


def test_outside_the_project_the_per_user_dir_is_used_and_named(project: Path) -> None:
    outside = project.parent / "elsewhere"
    state = project.parent / "state"
    status = ksi(outside, "daemon", "status", XDG_STATE_HOME=str(state))
    assert status.returncode == 3
    assert status.stdout == ""
    assert str(state / "ksi") in status.stderr
    listed = ksi(outside, "conversations", "--json", XDG_STATE_HOME=str(state))
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout)["total"] == 0
    assert f"no conversations in {state / 'ksi'}" in listed.stderr
    sent = ksi(outside, "send", "system:health", XDG_STATE_HOME=str(state))
    assert sent.returncode == 3
    assert str(state / "ksi") in sent.stderr and "ksi daemon start" in sent.stderr
    # KSI_VAR_DIR names the project's var dir from anywhere
    named = ksi(outside, "daemon", "status", "--json", KSI_VAR_DIR=str(project / "var"))
    assert named.returncode == 0, named.stderr
    assert json.loads(named.stdout)["var_dir_found_by"] == "KSI_VAR_DIR"


def test_a_var_dir_without_the_marker_is_not_adopted(tmp_path: Path) -> None:
    (tmp_path / "var" / "logs").mkdir(parents=True)
    status = ksi(tmp_path, "daemon", "status", XDG_STATE_HOME=str(tmp_path / "state"))
    assert status.returncode == 3
    assert str(tmp_path / "state" / "ksi") in status.stderr
    assert os.listdir(tmp_path / "var") == ["logs"]


def test_a_var_dir_that_is_a_file_is_one_clear_error(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("mine")
    for args, env in ((["conversations", "--var-dir", str(afile)], {}),
                      (["daemon", "start", "--var-dir", str(afile)], {}),
                      (["send", "system:health"], {"KSI_VAR_DIR": str(afile)})):
        run = ksi(tmp_path, *args, **env)
        assert run.returncode == 1, (args, run.stderr)
        assert json.loads(run.stderr)["error"]["code"] == "var_dir_invalid", run.stderr
        assert "Traceback" not in run.stderr
    daemon = subprocess.run([sys.executable, "-m", "ksi_daemon", "--quiet", "--var-dir", str(afile),
                             "--socket", str(tmp_path / "d.sock")], cwd=tmp_path, env=clean_env(),
                            capture_output=True, text=True, timeout=TIMEOUT)
    assert daemon.returncode == 2 and "cannot use the var dir" in daemon.stderr and "Traceback" not in daemon.stderr
    assert afile.read_text() == "mine"  # nothing written over it
    under = ksi(tmp_path, "daemon", "start", "--var-dir", str(afile / "var"))  # a file on the way to it
    assert under.returncode == 1 and "cannot use the var dir" in under.stderr and "Traceback" not in under.stderr
