"""Is the daemon of a var dir alive? Its pid file, its process and its socket."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path
from typing import Literal

from ksi_common.layout import VarLayout


def pid_alive(pid: int) -> bool:
    """True when `pid` runs (a zombie counts as gone)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def socket_answers(path: Path, timeout: float = 1.0) -> bool:
    """True when something accepts connections on the Unix socket `path`."""
    if not path.exists():
        return False
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        sock.close()


def read_pid(layout: VarLayout) -> int | None:
    try:
        return int(layout.pid_file.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


SocketPathState = Literal["absent", "live", "stale", "foreign"]


def socket_path_state(path: Path) -> SocketPathState:
    """What is at a socket path: nothing, a socket that answers, a socket nobody listens on
    (stale: safe to remove), or something that is not a socket (never ours to remove)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return "absent"
    if not stat.S_ISSOCK(mode):
        return "foreign"
    return "live" if socket_answers(path) else "stale"
