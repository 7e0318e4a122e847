"""`ksi daemon start` against a daemon that runs with other settings, and `ksi daemon restart`
checking the new settings and HTTP address before it stops the running daemon; the real `ksi`
CLI as a subprocess."""

from __future__ import annotations

import json
import re
import socket
import subprocess
from collections.abc import Iterator

import pytest

from ksi_common import oneshot
from ksi_common.config_file import CONFIG_NAME
from tests.test_cli import Place, clean_env, force_stop, place, started_pid  # noqa: F401  (fixture)


@pytest.fixture
def started(place: Place) -> Iterator[tuple[Place, int]]:  # noqa: F811
    pid = started_pid(place.ksi("daemon", "start", *place.where))
    try:
        yield place, pid
    finally:
        place.ksi("daemon", "stop", *place.where)
        force_stop(pid)


def held_port() -> tuple[socket.socket, int]:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    return taken, taken.getsockname()[1]


def running_pid(where: Place) -> int | None:
    health = where.health()
    return None if health is None else int(health["pid"])


def test_a_start_with_other_settings_names_them_and_the_restart_that_applies_them(
        started: tuple[Place, int]) -> None:
    where, pid = started
    same = where.ksi("daemon", "start", *where.where)
    assert same.returncode == 0 and "already running" in same.stdout
    other = where.ksi("daemon", "start", *where.where, env=clean_env(KSI_DEFAULT_MODEL="echo/other"))
    assert other.returncode == 1, other.stdout
    assert "already running" not in other.stdout + other.stderr
    assert "KSI_DEFAULT_MODEL: running echo/default, asked echo/other" in other.stderr
    assert "apply them with: ksi daemon restart" in other.stderr
    with_http = where.ksi("daemon", "start", *where.where, "--http", "127.0.0.1:0")
    assert with_http.returncode == 1 and "KSI_HTTP_ADDR" in with_http.stderr
    assert "ksi daemon restart --http 127.0.0.1:0" in with_http.stderr
    assert running_pid(where) == pid  # nothing was stopped
    applied = where.ksi("daemon", "restart", *where.where, env=clean_env(KSI_DEFAULT_MODEL="echo/other"))
    assert applied.returncode == 0, applied.stderr
    new_pid = int(re.search(r"daemon started \(pid (\d+)\)", applied.stdout).group(1))  # type: ignore[union-attr]
    try:
        assert new_pid != pid
        assert "settings changed: KSI_DEFAULT_MODEL echo/default -> echo/other" in applied.stdout
        assert oneshot.request(where.socket, "system:config", timeout=5.0)["default_model"] == "echo/other"
    finally:
        where.ksi("daemon", "stop", *where.where)
        force_stop(new_pid)


def test_a_restart_checks_settings_and_port_before_it_stops_the_daemon(started: tuple[Place, int]) -> None:
    where, pid = started
    bad = where.ksi("daemon", "restart", *where.where, env=clean_env(KSI_MAX_CONCURRENCY="-3"))
    assert bad.returncode == 2
    assert "KSI_MAX_CONCURRENCY" in bad.stderr and "left as it is" in bad.stderr
    assert running_pid(where) == pid
    taken, port = held_port()
    with taken:
        held = where.ksi("daemon", "restart", *where.where, "--http", f"127.0.0.1:{port}")
    assert held.returncode == 2
    assert f"cannot serve HTTP on 127.0.0.1:{port}" in held.stderr and "left as it is" in held.stderr
    assert "daemon stopped" not in held.stdout
    assert running_pid(where) == pid  # the old daemon still serves


def test_a_restart_onto_a_database_it_cannot_open_leaves_the_daemon_running(started: tuple[Place, int]) -> None:
    where, pid = started
    closed, port = held_port()
    closed.close()  # a port nobody listens on: the connection is refused at once
    url = f"postgresql://ksi:secret-pw-4711@127.0.0.1:{port}/ksi"
    moved = where.ksi("daemon", "restart", *where.where, env=clean_env(KSI_STORAGE="postgres", KSI_DATABASE_URL=url))
    assert moved.returncode == 2, moved.stdout + moved.stderr
    assert "cannot open the database" in moved.stderr and "left as it is" in moved.stderr
    assert "secret-pw-4711" not in moved.stdout + moved.stderr
    assert "daemon stopped" not in moved.stdout
    assert running_pid(where) == pid


def bare_env(**extra: str) -> dict[str, str]:
    """A shell without any KSI_* variable (a new terminal the next day)."""
    return {k: v for k, v in clean_env(**extra).items() if not k.startswith("KSI_") or k in extra}


def new_pid_of(result: subprocess.CompletedProcess[str]) -> int:
    assert result.returncode == 0, result.stdout + result.stderr
    return int(re.search(r"daemon started \(pid (\d+)\)", result.stdout).group(1))  # type: ignore[union-attr]


def free_port() -> int:
    taken, port = held_port()
    taken.close()
    return port


@pytest.fixture
def with_http(place: Place) -> Iterator[tuple[Place, str]]:  # noqa: F811
    addr = f"127.0.0.1:{free_port()}"
    pids = [started_pid(place.ksi("daemon", "start", *place.where, "--http", addr))]
    try:
        yield place, addr
    finally:
        if (health := place.health()) is not None:
            pids.append(int(health["pid"]))
        place.ksi("daemon", "stop", *place.where)
        for pid in pids:
            force_stop(pid)


def test_a_restart_from_a_bare_shell_keeps_the_running_daemons_settings(with_http: tuple[Place, str]) -> None:
    where, addr = with_http
    again = where.ksi("daemon", "start", *where.where, env=bare_env())
    assert again.returncode == 0 and "already running" in again.stdout, again.stderr
    restarted = where.ksi("daemon", "restart", *where.where, env=bare_env())
    new_pid_of(restarted)
    assert "settings: the same as before" in restarted.stdout
    running = oneshot.request(where.socket, "system:config", {"origins": True}, timeout=5.0)
    assert running["settings"]["http_addr"] == addr and running["origins"]["http_addr"] == "kept"
    # KSI_LITELLM_PRELOAD came from the first start's environment: kept too
    assert running["settings"]["litellm_preload"] is False
    assert (where.health() or {}).get("http") == f"http://{addr}"
    shown = where.ksi("config", "show", "--origin", *where.where, env=bare_env())
    assert json.loads(shown.stdout)["origins"]["http_addr"] == "kept"


def test_a_restart_applies_the_file_and_reset_drops_what_was_kept(with_http: tuple[Place, str]) -> None:
    where, addr = with_http
    set_model = where.ksi("config", "set", *where.where, "default_model", "echo/filed", env=bare_env())
    assert set_model.returncode == 0, set_model.stderr
    assert (where.var_dir / CONFIG_NAME).is_file()
    pending = where.ksi("daemon", "start", *where.where, env=bare_env())
    assert pending.returncode == 0 and "already running" in pending.stdout
    assert "the configuration file changed KSI_DEFAULT_MODEL since the daemon started" in pending.stdout
    applied = where.ksi("daemon", "restart", *where.where, env=bare_env())
    new_pid_of(applied)
    assert "settings changed: KSI_DEFAULT_MODEL echo/default -> echo/filed" in applied.stdout
    assert (where.health() or {}).get("http") == f"http://{addr}"  # still kept
    reset = where.ksi("daemon", "restart", "--reset", *where.where, env=bare_env(KSI_LITELLM_PRELOAD="false"))
    new_pid_of(reset)
    assert f"KSI_HTTP_ADDR {addr} -> unset" in reset.stdout
    running = oneshot.request(where.socket, "system:config", timeout=5.0)
    assert running["http_addr"] is None and running["default_model"] == "echo/filed"
    settled = where.ksi("daemon", "start", *where.where, env=bare_env(KSI_LITELLM_PRELOAD="false"))
    assert settled.returncode == 0 and "note:" not in settled.stdout


def test_a_start_asking_for_other_settings_says_each_on_one_short_line(started: tuple[Place, int]) -> None:
    where, pid = started
    models = {f"provider-{n}/*": {"api_base": f"http://127.0.0.1:{9000 + n}/v1", "context_window": 32768,
                                  "output_reserve": 2048, "max_concurrency": 4} for n in range(5)}
    asked = where.ksi("daemon", "start", *where.where,
                      env=clean_env(KSI_MODELS=json.dumps(models), KSI_MAX_QUEUED="77"))
    assert asked.returncode == 1
    lines = asked.stderr.strip().splitlines()
    assert any(line.strip().startswith("KSI_MODELS: running {}, asked") for line in lines), asked.stderr
    assert any(line.strip() == "KSI_MAX_QUEUED: running 10000, asked 77" for line in lines), asked.stderr
    assert all(len(line) <= 120 for line in lines), asked.stderr
    assert lines[-1].endswith("apply them with: ksi daemon restart")
    assert running_pid(where) == pid


def test_a_restart_that_would_lose_a_secret_says_so_and_stops_nothing(place: Place) -> None:  # noqa: F811
    secret = "sk-only-in-the-first-shell-4711"
    pid = started_pid(place.ksi("daemon", "start", *place.where, env=clean_env(KSI_API_KEY=secret)))
    try:
        record = (place.var_dir / "run" / "settings.json").read_text()
        assert secret not in record and "api_key" in record
        lost = place.ksi("daemon", "restart", *place.where, env=bare_env())
        assert lost.returncode == 2
        assert "KSI_API_KEY" in lost.stderr and "left as it is" in lost.stderr
        assert "ksi config set api_key -" in lost.stderr
        assert secret not in lost.stdout + lost.stderr
        assert running_pid(place) == pid
        again = place.ksi("daemon", "restart", *place.where, env=bare_env(KSI_API_KEY=secret))
        new_pid_of(again)
        assert "settings: the same as before" in again.stdout
    finally:
        health = place.health()
        place.ksi("daemon", "stop", *place.where)
        force_stop(pid)
        if health is not None:
            force_stop(int(health["pid"]))
