"""The socket path may name a shared directory or a file that is not ours: the daemon and
`ksi doctor --repair` change no mode they did not set and remove nothing but a stale KSI socket."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from ksi_cli.main import cli
from ksi_common.client import KsiClient
from ksi_daemon.daemon import Daemon, DaemonAlreadyRunning, UnsafeSocketPath
from tests.conftest import make_settings, running_daemon


@pytest.fixture(autouse=True)
def owner_only_umask() -> Iterator[None]:
    """Var dirs built by hand here are owner-only, as the daemon makes them (loose modes are a
    finding of their own, tested in test_privacy.py)."""
    old = os.umask(0o077)
    yield
    os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def shared_dir(root: Path) -> Path:
    shared = root / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # as /tmp is
    return shared


async def test_a_shared_socket_directory_keeps_its_mode(short_tmp: Path) -> None:
    shared = shared_dir(short_tmp)
    async with running_daemon(short_tmp, socket_path=shared / "k.sock") as daemon:
        assert mode(shared) == 0o1777
        assert mode(daemon.settings.socket) == 0o600
        async with KsiClient(daemon.settings.socket) as client:
            assert (await client.request("system:health"))["status"] == "healthy"
    assert mode(shared) == 0o1777


@pytest.mark.parametrize("kind", ["file", "symlink", "directory"])
async def test_what_is_not_a_socket_is_never_removed(short_tmp: Path, kind: str) -> None:
    shared = shared_dir(short_tmp)
    sock = shared / "k.sock"
    precious = short_tmp / "precious.txt"
    precious.write_text("keep me")
    if kind == "file":
        sock.write_text("keep me")
    elif kind == "symlink":
        sock.symlink_to(precious)
    else:
        sock.mkdir()
    daemon = Daemon(make_settings(short_tmp, socket_path=sock))
    with pytest.raises(UnsafeSocketPath):
        await daemon.start()
    assert mode(shared) == 0o1777
    assert precious.read_text() == "keep me"
    if kind == "file":
        assert sock.read_text() == "keep me"
    elif kind == "symlink":
        assert sock.is_symlink() and sock.readlink() == precious
    else:
        assert sock.is_dir()
    assert not daemon.layout.pid_file.exists()
    # the failed start let go of the var dir: a daemon on another socket starts on it
    async with running_daemon(short_tmp, socket_path=short_tmp / "d.sock"):
        pass


async def test_a_live_socket_of_someone_else_is_left_alone(short_tmp: Path) -> None:
    sock = short_tmp / "other.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock))
    listener.listen(1)
    try:
        with pytest.raises(DaemonAlreadyRunning):
            await Daemon(make_settings(short_tmp, socket_path=sock)).start()
        assert stat.S_ISSOCK(sock.lstat().st_mode)
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(str(sock))  # still the listener's
        client.close()
    finally:
        listener.close()


def test_doctor_repair_keeps_a_file_at_the_socket_path(short_tmp: Path) -> None:
    var = short_tmp / "var"
    (var / "run").mkdir(parents=True, mode=0o700)
    shared = shared_dir(short_tmp)
    sock = shared / "k.sock"
    sock.write_text("not a socket")
    result = CliRunner().invoke(cli, ["doctor", "--json", "--repair", "--var-dir", str(var), "--socket", str(sock)])
    report = json.loads(result.output)
    assert result.exit_code == 1
    assert [p["kind"] for p in report["problems"]] == ["socket_path_occupied"]
    assert report["repaired"] == []
    assert sock.read_text() == "not a socket"
    assert mode(shared) == 0o1777


def test_doctor_repair_removes_a_stale_socket_only(short_tmp: Path) -> None:
    var = short_tmp / "var"
    (var / "run").mkdir(parents=True, mode=0o700)
    sock = short_tmp / "k.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(sock))
    stale.close()
    result = CliRunner().invoke(cli, ["doctor", "--json", "--repair", "--var-dir", str(var), "--socket", str(sock)])
    report = json.loads(result.output)
    assert [r["kind"] for r in report["repaired"]] == ["stale_socket"]
    assert not sock.exists()


def test_a_socket_path_too_long_for_a_unix_socket_is_refused_before_anything_is_made(short_tmp: Path) -> None:
    from ksi_daemon.transports.unix import SOCKET_PATH_LIMIT, SocketPathTooLong

    fits = short_tmp / ("s" * (SOCKET_PATH_LIMIT - len(os.fsencode(short_tmp)) - 1))
    assert len(os.fsencode(fits)) == SOCKET_PATH_LIMIT
    Daemon(make_settings(short_tmp, socket_path=fits))  # the longest path that fits is taken
    long = short_tmp / ("s" * 150)
    with pytest.raises(SocketPathTooLong, match=f"at most {SOCKET_PATH_LIMIT}"):
        Daemon(make_settings(short_tmp, socket_path=long))
    # as a process: one line and exit code 2, no traceback, no socket
    run = subprocess.run([sys.executable, "-m", "ksi_daemon", "--quiet", "--var-dir", str(short_tmp / "var2"),
                          "--socket", str(long)], capture_output=True, text=True, timeout=60, cwd=short_tmp)
    assert run.returncode == 2 and "choose a shorter --socket" in run.stderr and "Traceback" not in run.stderr
    assert not long.exists()
