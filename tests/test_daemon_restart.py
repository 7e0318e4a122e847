"""`ksi daemon start` against a daemon that runs with other settings, and `ksi daemon restart`
checking the new settings and HTTP address before it stops the running daemon; the real `ksi`
CLI as a subprocess."""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator

import pytest

from ksi_common import oneshot
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
    assert "KSI_DEFAULT_MODEL: running echo/default, this start echo/other" in other.stderr
    assert "ksi daemon restart" in other.stderr
    with_http = where.ksi("daemon", "start", *where.where, "--http", "127.0.0.1:0")
    assert with_http.returncode == 1 and "KSI_HTTP_ADDR" in with_http.stderr
    assert "ksi daemon restart --http 127.0.0.1:0" in with_http.stderr
    assert running_pid(where) == pid  # nothing was stopped
    applied = where.ksi("daemon", "restart", *where.where, env=clean_env(KSI_DEFAULT_MODEL="echo/other"))
    assert applied.returncode == 0, applied.stderr
    new_pid = int(re.search(r"daemon started \(pid (\d+)\)", applied.stdout).group(1))  # type: ignore[union-attr]
    try:
        assert new_pid != pid
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
