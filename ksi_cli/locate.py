"""Find the var dir and socket the way the daemon does, without loading its settings."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ksi_common.layout import VarLayout


def _dotenv(name: str) -> str | None:
    env_file = Path(".env")
    if not env_file.is_file():
        return None
    from dotenv import dotenv_values

    return dotenv_values(env_file).get(name)


def _setting(name: str) -> str | None:
    return os.environ.get(name) or _dotenv(name)


@dataclass(frozen=True)
class Location:
    var_dir: Path
    socket: Path

    @property
    def layout(self) -> VarLayout:
        return VarLayout(self.var_dir)


def locate(var_dir: str | None = None, socket: str | None = None) -> Location:
    """Command-line options first, then `KSI_*` variables, then `.env`, then `./var`."""
    root = Path(var_dir or _setting("KSI_VAR_DIR") or "var")
    sock = socket or (None if var_dir else _setting("KSI_SOCKET_PATH"))
    return Location(root, Path(sock) if sock else VarLayout(root).default_socket)
