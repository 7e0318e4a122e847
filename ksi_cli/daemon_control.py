"""Start, stop and query a background daemon from the CLI, without importing it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ksi_common import oneshot
from ksi_common.errors import KsiError
from ksi_common.events import SYSTEM_CONFIG, SYSTEM_HEALTH, SYSTEM_SHUTDOWN
from ksi_common.layout import mark_var_dir
from ksi_common.liveness import pid_alive, read_pid
from ksi_common.locate import Location
from ksi_common.privacy import open_private, private_dir


class StartFailed(RuntimeError):
    """The daemon did not start; `exit_code` is the daemon's own when it exited saying why."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# exit codes of ksi-daemon passed on by `ksi daemon start`: 2 a setting, address or var dir it
# cannot use, 3 another daemon holds the var dir, 4 the storage cannot be opened
DAEMON_EXIT_CODES = (2, 3, 4)


def running_config(location: Location, timeout: float = 2.0) -> dict | None:
    """The running daemon's settings (secrets masked), or None when none answers."""
    try:
        return oneshot.request(location.socket, SYSTEM_CONFIG, timeout=timeout)
    except KsiError:
        return None


def running_origins(location: Location, timeout: float = 2.0) -> dict[str, str]:
    """Where each of the running daemon's settings came from ({} from a daemon that does not say)."""
    try:
        answer = oneshot.request(location.socket, SYSTEM_CONFIG, {"origins": True}, timeout=timeout)
    except KsiError:
        return {}
    origins = answer.get("origins") if isinstance(answer, dict) else None
    return origins if isinstance(origins, dict) else {}


def health(location: Location, timeout: float = 2.0) -> dict | None:
    try:
        return oneshot.request(location.socket, SYSTEM_HEALTH, timeout=timeout)
    except KsiError:
        return None


def start(location: Location, wait: float = 15.0, http_addr: str | None = None,
          keep_settings: bool = False) -> tuple[int, str]:
    """Spawn the daemon detached and return (pid, message) once the socket answers; with
    `keep_settings`, under the settings the previous daemon of the var dir was given."""
    running = health(location)
    if running:
        theirs = running.get("var_dir")
        if theirs is not None and Path(theirs).resolve() != location.var_dir.resolve():
            raise StartFailed(f"another daemon (pid {running.get('pid')}, var dir {theirs}) answers on "
                               f"{location.socket}; choose another --socket")
        return int(running["pid"]), (f"daemon already running (pid {running.get('pid')}) on {location.socket}, "
                                     f"var dir {location.describe()}")
    log_dir = location.layout.daemon_log.parent
    command = [sys.executable, "-m", "ksi_daemon", "--quiet",
               "--var-dir", str(location.var_dir), "--socket", str(location.socket)]
    if http_addr:
        command += ["--http", http_addr]
    if keep_settings:
        command.append("--keep-settings")
    try:
        mark_var_dir(location.var_dir)
        private_dir(log_dir)
        stderr_fd = open_private(log_dir / "stderr.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    except OSError as exc:  # a file on the way to it, or a directory this user cannot write
        raise StartFailed(f"cannot use the var dir {location.var_dir}: {exc.strerror or exc} ({exc.filename})") from None
    with os.fdopen(stderr_fd, "ab") as stderr:
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr,
            start_new_session=True,
        )
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        code = process.poll()
        if code is not None:
            tail = (log_dir / "stderr.log").read_text(errors="replace").strip().splitlines()[-1:]
            raise StartFailed(f"the daemon exited with code {code}: {' '.join(tail)}",
                              code if code in DAEMON_EXIT_CODES else 1)
        if (info := health(location, timeout=1.0)) is not None:
            where = f"{location.socket} and {info['http']}" if info.get("http") else str(location.socket)
            return int(info["pid"]), f"daemon started (pid {info['pid']}) on {where}, var dir {location.describe()}"
        time.sleep(0.02)
    process.terminate()
    raise StartFailed(f"the daemon did not answer on {location.socket} within {wait}s")


def stop(location: Location, timeout: float = 15.0) -> str:
    """Ask for a graceful shutdown; SIGTERM after `timeout`, SIGKILL as the last resort."""
    pid = read_pid(location.layout)
    info = health(location)
    if info is None and pid is None:
        return "daemon is not running"
    pid = int(info["pid"]) if info else pid
    if info is not None:
        try:
            oneshot.request(location.socket, SYSTEM_SHUTDOWN, timeout=5.0)
        except KsiError:
            pass
    for sig, grace in ((None, timeout), (signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)):
        if pid is None:
            break
        if sig is not None and pid_alive(pid):
            os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and pid_alive(pid):
            time.sleep(0.02)
        if not pid_alive(pid):
            return f"daemon stopped (pid {pid})"
    return f"daemon (pid {pid}) did not stop"
