"""The `ksi` command line, run as a real process (`python -m ksi_cli`) against real daemons.

Each daemon started here is a subprocess and pays its start-up: there are only three.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import pytest

from ksi_cli.event_args import EventArgsError, event_words, json_value
from ksi_cli.main import COMMANDS, cli
from ksi_common import __version__, oneshot
from ksi_common.errors import KsiError
from ksi_common.liveness import pid_alive
from tests.conftest import PROVIDER_PREFIXES

TIMEOUT = 30.0


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(PROVIDER_PREFIXES)}
    env.update({
        "OPENAI_API_KEY": "sk-test-dummy",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_MODE": "PRODUCTION",
        "KSI_LITELLM_PRELOAD": "false",
    })
    env.update(extra)
    return env


@dataclass
class Place:
    root: Path

    @property
    def var_dir(self) -> Path:
        return self.root / "var"

    @property
    def socket(self) -> Path:
        return self.root / "d.sock"

    @property
    def pid_file(self) -> Path:
        return self.var_dir / "run" / "daemon.pid"

    @property
    def where(self) -> list[str]:
        return ["--var-dir", str(self.var_dir), "--socket", str(self.socket)]

    def ksi(self, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run `ksi ARGS` in this place's directory (so no stray .env is read), output piped."""
        return subprocess.run(
            [sys.executable, "-m", "ksi_cli", *args], cwd=self.root, env=env or clean_env(),
            capture_output=True, text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL,
        )

    def send(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.ksi("send", "--socket", str(self.socket), *args)

    def health(self) -> dict | None:
        try:
            return oneshot.request(self.socket, "system:health", timeout=5.0)
        except KsiError:
            return None


def started_pid(result: subprocess.CompletedProcess[str]) -> int:
    assert result.returncode == 0, result.stderr
    match = re.search(r"pid (\d+)", result.stdout)
    assert match, result.stdout
    return int(match.group(1))


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.02)
    return False


def force_stop(pid: int | None) -> None:
    if pid is not None and pid_alive(pid):
        os.kill(pid, signal.SIGKILL)
        wait_gone(pid)


def new_place() -> Place:
    return Place(Path(tempfile.mkdtemp(prefix="ksi-", dir="/tmp")))


@pytest.fixture
def place() -> Iterator[Place]:
    where = new_place()
    yield where
    shutil.rmtree(where.root, ignore_errors=True)


@pytest.fixture(scope="module")
def running() -> Iterator[tuple[Place, int]]:
    """One daemon started with `ksi daemon start`, shared by the tests that only talk to it."""
    where = new_place()
    result = where.ksi("daemon", "start", *where.where)
    pid = None
    try:
        pid = started_pid(result)
        yield where, pid
    finally:
        if pid is not None:
            where.ksi("daemon", "stop", *where.where)
            force_stop(pid)
        shutil.rmtree(where.root, ignore_errors=True)


# -- against a running daemon ------------------------------------------------------


def test_daemon_start_returns_once_healthy(running: tuple[Place, int]) -> None:
    where, pid = running
    # no retry: the socket answers as soon as `ksi daemon start` has returned
    health = oneshot.request(where.socket, "system:health", timeout=5.0)
    assert health["pid"] == pid
    assert where.pid_file.read_text().strip() == str(pid)
    assert oct(where.socket.stat().st_mode & 0o777) == oct(0o600)
    assert oct(where.pid_file.parent.stat().st_mode & 0o777) == oct(0o700)


def test_second_start_says_it_runs_and_a_second_daemon_is_refused(running: tuple[Place, int]) -> None:
    where, pid = running
    result = where.ksi("daemon", "start", *where.where)
    assert result.returncode == 0, result.stderr
    assert "already running" in result.stdout
    assert str(pid) in result.stdout
    # the daemon itself refuses a second instance on the same var dir, even on another socket
    direct = subprocess.run(
        [sys.executable, "-m", "ksi_daemon", "--quiet", "--var-dir", str(where.var_dir),
         "--socket", str(where.root / "second.sock")],
        cwd=where.root, env=clean_env(), capture_output=True, text=True, timeout=TIMEOUT,
    )
    assert direct.returncode == 3
    assert "already running" in direct.stderr
    assert not (where.root / "second.sock").exists()
    # the first one still answers, with the same pid
    health = where.health()
    assert health is not None and health["pid"] == pid


def test_send_health_prints_json_when_piped(running: tuple[Place, int]) -> None:
    where, pid = running
    result = where.send("system:health")
    assert result.returncode == 0, result.stderr
    health = json.loads(result.stdout)
    assert health["status"] == "healthy"
    assert health["pid"] == pid


def test_send_with_event_args(running: tuple[Place, int]) -> None:
    where, _pid = running
    result = where.send("--json", "system:help", "--event", "system:health")
    assert result.returncode == 0, result.stderr
    reply = json.loads(result.stdout)
    assert reply["event"] == "system:health"
    assert reply["fields"] == {}
    result = where.send("system:help", "--event=monitor:subscribe")
    assert json.loads(result.stdout)["event"] == "monitor:subscribe"
    result = where.send("--data", '{"event": "system:discover"}', "system:help")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["event"] == "system:discover"
    # a number is JSON, coerced to text by the daemon: unknown event, not a validation error
    result = where.send("system:help", "--event", "42")
    assert result.returncode == 1
    assert result.stdout == ""
    assert json.loads(result.stderr)["error"]["code"] == "unknown_event"


def test_send_dashed_key_and_flag_reach_the_daemon(running: tuple[Place, int]) -> None:
    where, _pid = running
    result = where.send("system:help", "--event", "system:health", "--some-key", "--other-flag")
    assert result.returncode == 1
    error = json.loads(result.stderr)["error"]
    assert error["code"] == "validation_error"
    assert {"some_key", "other_flag"} <= set(error["details"]["fields"])


def test_send_bad_event_exits_1_with_the_code(running: tuple[Place, int]) -> None:
    where, _pid = running
    result = where.send("system:helth")
    assert result.returncode == 1
    error = json.loads(result.stderr)["error"]
    assert error["code"] == "unknown_event"
    assert "system:health" in error["details"]["similar"]
    # a string field takes the word as written, even when it looks like JSON
    result = where.send("system:help", "--event", '{"x": 1}')
    assert result.returncode == 1
    assert "{\"x\": 1}" in json.loads(result.stderr)["error"]["message"]
    result = where.send("monitor:subscribe", "--patterns", "5")
    assert result.returncode == 1
    assert json.loads(result.stderr)["error"]["code"] == "validation_error"


def test_status_when_running(running: tuple[Place, int]) -> None:
    where, pid = running
    result = where.ksi("daemon", "status", *where.where)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["pid"] == pid


def test_discover_and_help_commands(running: tuple[Place, int]) -> None:
    where, _pid = running
    result = where.ksi("discover", "--socket", str(where.socket), "monitor")
    assert result.returncode == 0, result.stderr
    assert set(json.loads(result.stdout)["events"]) == {"monitor:subscribe", "monitor:unsubscribe"}
    result = where.ksi("help", "--socket", str(where.socket), "system:help")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["fields"]["event"]["required"] is True


CLIENT_IMPORTS = """
import json, sys
sys.argv = ["ksi", "send", "--socket", sys.argv[1], "system:health"]
from ksi_cli.main import main
try:
    main()
except SystemExit as exc:
    code = exc.code
heavy = sorted(name for name in sys.modules
               if name.split(".")[0] in ("litellm", "ksi_daemon", "pydantic", "pydantic_settings", "openai"))
ours = sorted(name for name in sys.modules if name.startswith(("ksi_cli.", "ksi_common.")))
print(json.dumps({"code": code, "heavy": heavy, "ours": ours}), file=sys.stderr)
"""


def test_client_path_stays_light(running: tuple[Place, int]) -> None:
    where, pid = running
    result = subprocess.run(
        [sys.executable, "-c", CLIENT_IMPORTS, str(where.socket)], cwd=where.root, env=clean_env(),
        capture_output=True, text=True, timeout=TIMEOUT,
    )
    report = json.loads(result.stderr.strip().splitlines()[-1])
    assert report["code"] == 0
    assert json.loads(result.stdout)["pid"] == pid  # it really talked to the daemon
    assert report["heavy"] == []
    # the other commands' modules are loaded only when those commands run
    lazy_modules = {module for module, _attribute in COMMANDS.values()} - {"ksi_cli.send"} | {"ksi_cli.daemon_control"}
    assert not lazy_modules & set(report["ours"]), report["ours"]


def test_every_command_is_reachable() -> None:
    from ksi_cli.inspect_commands import COMMANDS as INSPECTION

    context = click.Context(cli)
    names = cli.list_commands(context)
    for name in names:
        assert cli.get_command(context, name) is not None, name
    for command in INSPECTION:
        assert command.name in names
        assert cli.get_command(context, command.name) is command
    assert {"send", "daemon", "config", "discover", "help", *COMMANDS} <= set(names)


# -- without a daemon ---------------------------------------------------------------


def test_send_with_daemon_down_exits_3(place: Place) -> None:
    result = place.send("system:health")
    assert result.returncode == 3
    assert "ksi daemon start" in result.stderr
    assert result.stdout == ""
    assert json.loads(result.stderr.splitlines()[0])["error"]["code"] == "daemon_unreachable"
    result = place.ksi("daemon", "status", *place.where)
    assert result.returncode == 3
    assert "not running" in result.stderr


def test_usage_errors_exit_2(place: Place) -> None:
    result = place.send("system:help", "2")
    assert result.returncode == 2
    assert "--key" in result.stderr
    result = place.send("--data", "{not json", "system:health")
    assert result.returncode == 2
    result = place.send("--data", "[1]", "system:health")
    assert result.returncode == 2
    result = place.ksi("send")
    assert result.returncode == 2


def test_version(place: Place) -> None:
    result = place.ksi("--version")
    assert result.returncode == 0
    assert __version__ in result.stdout


def test_config_masks_secrets(place: Place) -> None:
    secret = "sk-secret-value"
    result = place.ksi("config", env=clean_env(KSI_API_KEY=secret, KSI_LINE_LIMIT="4242"))
    assert result.returncode == 0, result.stderr
    assert secret not in result.stdout + result.stderr
    settings = json.loads(result.stdout)
    assert settings["api_key"] == "***"
    assert settings["line_limit"] == 4242
    result = place.ksi("config")
    assert json.loads(result.stdout)["api_key"] is None


def test_config_reads_dot_env_and_masks_it(place: Place) -> None:
    (place.root / ".env").write_text("KSI_API_KEY=sk-from-dotenv-file\nKSI_PUSH_QUEUE_SIZE=77\n")
    result = place.ksi("config")
    assert result.returncode == 0, result.stderr
    assert "sk-from-dotenv-file" not in result.stdout
    settings = json.loads(result.stdout)
    assert (settings["api_key"], settings["push_queue_size"]) == ("***", 77)


# -- lifecycle through the CLI --------------------------------------------------------


def test_stale_files_from_a_killed_daemon_then_stop(place: Place) -> None:
    killed = subprocess.Popen(
        [sys.executable, "-m", "ksi_daemon", "--quiet", *place.where], cwd=place.root, env=clean_env(),
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    new_pid = None
    try:
        deadline = time.monotonic() + TIMEOUT
        while place.health() is None:
            assert killed.poll() is None, "the daemon exited early"
            assert time.monotonic() < deadline, "the daemon did not come up"
            time.sleep(0.02)
        killed.send_signal(signal.SIGKILL)
        killed.wait(TIMEOUT)
        # it left its socket and pid file behind
        assert place.socket.exists()
        assert place.pid_file.read_text().strip() == str(killed.pid)
        assert place.ksi("daemon", "status", *place.where).returncode == 3
        assert place.send("system:health").returncode == 3

        result = place.ksi("daemon", "start", *place.where)
        new_pid = started_pid(result)
        assert new_pid != killed.pid
        assert place.pid_file.read_text().strip() == str(new_pid)
        assert place.ksi("daemon", "status", *place.where).returncode == 0

        result = place.ksi("daemon", "stop", *place.where)
        assert result.returncode == 0, result.stderr
        assert "stopped" in result.stdout
        assert wait_gone(new_pid)
        assert not place.socket.exists()
        assert not place.pid_file.exists()
        assert place.ksi("daemon", "status", *place.where).returncode == 3
        # stopping again is harmless
        result = place.ksi("daemon", "stop", *place.where)
        assert result.returncode == 0
        assert "not running" in result.stdout
    finally:
        if killed.poll() is None:
            killed.kill()
            killed.wait()
        force_stop(new_pid)


# -- event words ---------------------------------------------------------------------


def parse_event_args(words: list[str]) -> dict[str, Any]:
    """What `ksi send` makes of its words when the event's field types are not asked for."""
    return {key: True if raw is None else json_value(raw) for key, raw in event_words(words)}


@pytest.mark.parametrize(("words", "expected"), [
    ([], {}),
    (["--prompt", "hi there"], {"prompt": "hi there"}),
    (["--prompt", "42"], {"prompt": 42}),
    (["--n", "3.5", "--ok", "false", "--x", "null"], {"n": 3.5, "ok": False, "x": None}),
    (["--flag"], {"flag": True}),
    (["--flag", "--name", "bob"], {"flag": True, "name": "bob"}),
    (["--name", "bob", "--flag"], {"name": "bob", "flag": True}),
    (["--some-key", "v"], {"some_key": "v"}),
    (["--some-key=v"], {"some_key": "v"}),
    (["--tags", '["a", "b"]'], {"tags": ["a", "b"]}),
    (["--meta", '{"k": 1}'], {"meta": {"k": 1}}),
    (["--text", "{not json"], {"text": "{not json"}),
    (["--empty", ""], {"empty": ""}),
    (["--a", "1", "--a", "2"], {"a": 2}),
])
def test_parse_event_args(words: list[str], expected: dict) -> None:
    assert parse_event_args(words) == expected


@pytest.mark.parametrize("words", [["2"], ["prompt", "hi"], ["--"], ["--a", "1", "stray"], ["-x"]])
def test_parse_event_args_refuses_words_without_a_key(words: list[str]) -> None:
    with pytest.raises(EventArgsError):
        parse_event_args(words)


def test_a_setting_that_does_not_fit_is_named_on_one_line(place: Place) -> None:
    """`ksi daemon start` shows the daemon's last line of stderr: it must name the variable."""
    bad = clean_env(KSI_MAX_CONCURRENCY="-3", KSI_MODELS='{"openai/*": {"max_concurrency": 0}}')
    start = place.ksi("daemon", "start", *place.where, env=bad)
    assert start.returncode == 2 and "Traceback" not in start.stderr  # the daemon's own exit code
    assert "exited with code 2" in start.stderr and "KSI_MAX_CONCURRENCY: Input should be greater than 0" in start.stderr
    assert not place.socket.exists()
    shown = place.ksi("config", "--json", *place.where, env=bad)
    error = json.loads(shown.stderr)["error"]
    assert shown.returncode == 1 and error["code"] == "validation_error"
    assert set(error["details"]["fields"]) == {"KSI_MAX_CONCURRENCY", "KSI_MODELS.openai/*.max_concurrency"}
    unparsed = subprocess.run([sys.executable, "-m", "ksi_daemon", "--quiet", *place.where],
                              env=clean_env(KSI_MODELS="{not json"), capture_output=True, text=True, timeout=TIMEOUT)
    assert unparsed.returncode == 2 and unparsed.stderr.count("\n") == 1 and "KSI_MODELS" in unparsed.stderr
    assert "expected a JSON object" in unparsed.stderr
