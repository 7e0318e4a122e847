"""The daemon's lifecycle in-process: files it owns, shutdown, one daemon per var dir, peer checks."""

from __future__ import annotations

import asyncio
import os
import pwd
import socket
import stat
from pathlib import Path
from typing import Any

import pytest

from ksi_common.client import KsiClient
from ksi_daemon.context import EventContext
from ksi_daemon.daemon import Daemon, DaemonAlreadyRunning, UnsafeVarDir
from ksi_daemon.events import NoData
from tests.conftest import make_settings, running_daemon

TIMEOUT = 10.0


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


async def test_default_socket_is_private(short_tmp: Path) -> None:
    async with running_daemon(short_tmp, socket_path=None) as daemon:
        sock = short_tmp / "var" / "run" / "daemon.sock"
        assert daemon.settings.socket == sock
        assert stat.S_ISSOCK(sock.lstat().st_mode)
        assert mode(sock) == 0o600
        assert mode(sock.parent) == 0o700
        assert daemon.layout.pid_file.read_text().strip() == str(os.getpid())
        async with KsiClient(sock) as client:
            assert (await client.request("system:health"))["status"] == "healthy"
    assert not sock.exists()
    assert not daemon.layout.pid_file.exists()


async def test_explicit_socket_is_private(daemon: Daemon) -> None:
    sock = daemon.settings.socket
    assert mode(sock) == 0o600
    assert mode(sock.parent) == 0o700


async def test_world_writable_run_dir_is_refused(short_tmp: Path) -> None:
    run_dir = short_tmp / "var" / "run"
    run_dir.mkdir(parents=True)
    run_dir.chmod(0o777)
    daemon = Daemon(make_settings(short_tmp))
    with pytest.raises(UnsafeVarDir):
        await daemon.start()
    assert not daemon.settings.socket.exists()
    assert not daemon.layout.pid_file.exists()
    # group-writable is refused too
    run_dir.chmod(0o770)
    with pytest.raises(UnsafeVarDir):
        await Daemon(make_settings(short_tmp)).start()


async def test_second_daemon_on_the_same_var_dir_is_refused(daemon: Daemon, short_tmp: Path) -> None:
    second = Daemon(make_settings(short_tmp, socket_path=short_tmp / "other.sock"))
    with pytest.raises(DaemonAlreadyRunning) as caught:
        await second.start()
    assert str(os.getpid()) in str(caught.value)
    assert not (short_tmp / "other.sock").exists()
    # the first one is untouched
    assert daemon.layout.pid_file.read_text().strip() == str(os.getpid())
    async with KsiClient(daemon.settings.socket) as client:
        assert (await client.request("system:health"))["status"] == "healthy"


async def test_stale_socket_and_pid_file_are_replaced(short_tmp: Path) -> None:
    settings = make_settings(short_tmp)
    run_dir = settings.layout.run_dir
    run_dir.mkdir(parents=True, mode=0o700)
    settings.layout.pid_file.write_text("999999\n")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(settings.socket))
    stale.close()  # the file stays, nobody listens on it
    assert settings.socket.exists()
    async with running_daemon(short_tmp) as daemon:
        assert daemon.layout.pid_file.read_text().strip() == str(os.getpid())
        async with KsiClient(daemon.settings.socket) as client:
            assert (await client.request("system:health"))["status"] == "healthy"


async def test_restart_on_the_same_var_dir(short_tmp: Path) -> None:
    for _ in range(2):
        async with running_daemon(short_tmp) as daemon:
            async with KsiClient(daemon.settings.socket) as client:
                assert (await client.request("system:health"))["status"] == "healthy"


async def test_system_shutdown_stops_the_daemon(short_tmp: Path) -> None:
    daemon = Daemon(make_settings(short_tmp, shutdown_timeout=5.0))
    await daemon.start()
    serving = asyncio.create_task(daemon.serve_forever())
    sock = daemon.settings.socket
    pid_file = daemon.layout.pid_file
    try:
        released = asyncio.Event()

        async def slow(_data: NoData, _context: EventContext) -> dict[str, Any]:
            released.set()
            await asyncio.sleep(0.3)
            return {"finished": True}

        daemon.router.register("test:slow", slow, NoData, "in flight during shutdown")
        async with KsiClient(sock) as worker, KsiClient(sock) as admin:
            in_flight = asyncio.create_task(worker.send_frame("test:slow"))
            await asyncio.wait_for(released.wait(), TIMEOUT)
            reply = await admin.request("system:shutdown")
            assert reply == {"status": "shutting_down"}
            # in-flight work is drained, not dropped
            finished = await asyncio.wait_for(in_flight, TIMEOUT)
            assert finished["data"] == {"finished": True}
        await asyncio.wait_for(serving, TIMEOUT)
    finally:
        if not serving.done():
            daemon.request_shutdown()
            await serving
    assert not sock.exists()
    assert not pid_file.exists()
    with pytest.raises(OSError):
        await asyncio.open_unix_connection(str(sock))
    # the var dir is free again: a new daemon can take it
    async with running_daemon(short_tmp):
        pass


async def test_requests_during_shutdown_are_refused(short_tmp: Path) -> None:
    async with running_daemon(short_tmp) as daemon:
        async with KsiClient(daemon.settings.socket) as client:
            daemon.shutting_down = True
            reply = await client.send_frame("system:discover")
            assert reply["error"]["code"] == "shutting_down"
            # health still answers so supervisors can watch the drain
            assert (await client.request("system:health"))["status"] == "healthy"


# -- other users ------------------------------------------------------------------

REFUSED, ANSWERED, CLOSED, CONNECT_DENIED, OTHER = 0, 1, 2, 3, 4


def _child_probe(path: str, uid: int, gid: int) -> int:
    """Run in a forked child as another user: connect, ask for health, say what happened."""
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5.0)
    try:
        sock.connect(path)
    except PermissionError:
        return CONNECT_DENIED
    try:
        sock.sendall(b'{"event": "system:health", "correlation_id": "x"}\n')
    except (BrokenPipeError, ConnectionResetError):
        pass
    data = b""
    try:
        while b"\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except ConnectionResetError:
        pass
    if b'"healthy"' in data:
        return ANSWERED
    if b"invalid_request" in data:
        return REFUSED
    return CLOSED if not data else OTHER


async def probe_as_nobody(path: Path) -> int:
    nobody = pwd.getpwnam("nobody")
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = OTHER
        try:
            code = _child_probe(str(path), nobody.pw_uid, nobody.pw_gid)
        finally:
            os._exit(code)
    _pid, status = await asyncio.to_thread(os.waitpid, pid, 0)
    return os.waitstatus_to_exitcode(status)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another uid needs root")


def open_to_everyone(path: Path) -> None:
    """Loosen the file modes so that only the daemon's own peer check stands in the way."""
    for directory in (path.parent, *path.parent.parents):
        if directory == Path("/"):
            break
        directory.chmod(mode(directory) | 0o011)
    path.chmod(0o777)


@needs_root
async def test_connection_from_another_uid_is_refused(daemon: Daemon) -> None:
    sock = daemon.settings.socket
    # With the daemon's own modes the file system already keeps others out.
    assert await probe_as_nobody(sock) == CONNECT_DENIED
    # Even when the socket is reachable, the daemon refuses a peer of another uid.
    open_to_everyone(sock)
    assert await probe_as_nobody(sock) in (REFUSED, CLOSED)
    async with KsiClient(sock) as client:
        health = await client.request("system:health")
        assert health["status"] == "healthy"
        assert health["connections"] == 1


@needs_root
async def test_allowed_uid_is_served(short_tmp: Path) -> None:
    nobody = pwd.getpwnam("nobody")
    async with running_daemon(short_tmp, allow_uids=[nobody.pw_uid]) as daemon:
        open_to_everyone(daemon.settings.socket)
        assert await probe_as_nobody(daemon.settings.socket) == ANSWERED
