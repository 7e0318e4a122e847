"""Find the var dir and socket the way the daemon does, without loading its settings."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.layout import MARKER_NAME, VarLayout, find_var_dir, user_var_dir
from ksi_common.storage_backends import DEFAULT_STORAGE, needs_url


def _dotenv(name: str) -> str | None:
    env_file = Path(".env")
    if not env_file.is_file():
        return None
    from dotenv import dotenv_values

    return dotenv_values(env_file).get(name)


def _setting(name: str) -> str | None:
    return os.environ.get(name) or _dotenv(name)


def _setting_and_source(name: str) -> tuple[str | None, str]:
    if value := os.environ.get(name):
        return value, name
    return _dotenv(name), f"{name} in .env"


@dataclass(frozen=True)
class Location:
    var_dir: Path
    socket: Path
    found_by: str = "--var-dir"
    socket_given: bool = False  # --socket was on the command line
    storage: str = DEFAULT_STORAGE  # KSI_STORAGE: which backend the inspection commands read
    database_url: str | None = None  # KSI_DATABASE_URL, for a backend that needs one
    storage_given: bool = False  # KSI_STORAGE was set (else the running daemon may say which it uses)

    @property
    def layout(self) -> VarLayout:
        return VarLayout(self.var_dir)

    def describe(self) -> str:
        """Where the var dir is and why it was chosen, for messages that say where we looked."""
        return f"{self.var_dir} ({self.found_by})"

    def describe_storage(self) -> str:
        """Where the stored conversations and agents are read: the var dir or the database."""
        if needs_url(self.storage) and self.database_url:
            from ksi_common.dburl import mask_url

            return f"the database {mask_url(self.database_url)} (KSI_STORAGE={self.storage})"
        return self.describe()


def locate(var_dir: str | None = None, socket: str | None = None) -> Location:
    """Options first, then `KSI_*` variables and `.env`, then a marked project `var/`, then the per-user dir."""
    found_by = "--var-dir"
    if var_dir is None:
        var_dir, found_by = _setting_and_source("KSI_VAR_DIR")
    if var_dir is not None:
        root = Path(var_dir).absolute()
    else:
        root = find_var_dir()
        found_by = (f"project var dir, marked by {MARKER_NAME}" if root != user_var_dir()
                    else "per-user var dir")
    if root.exists() and not root.is_dir():  # every command would trip over it somewhere else
        raise KsiError(ErrorCode.VAR_DIR_INVALID, f"the var dir {root} ({found_by}) is not a directory",
                       var_dir=str(root))
    written = _configured(root)
    sock = socket or (None if found_by == "--var-dir" else _setting("KSI_SOCKET_PATH")) or written.get("socket_path")
    storage = _setting("KSI_STORAGE") or written.get("storage")
    return Location(root, Path(sock).absolute() if sock else VarLayout(root).default_socket, found_by,
                    socket_given=socket is not None, storage=storage or DEFAULT_STORAGE,
                    database_url=_setting("KSI_DATABASE_URL") or written.get("database_url"),
                    storage_given=bool(storage))


def _configured(root: Path) -> dict[str, str]:
    """The var dir's configuration file's say on where the daemon and its storage are (text
    values only); a file that cannot be used is left to the daemon and `ksi config` to report."""
    from ksi_common.config_file import config_path, read_config

    try:
        values = read_config(config_path(root))
    except KsiError:
        return {}
    return {k: v for k, v in values.items() if k in ("socket_path", "storage", "database_url") and isinstance(v, str)}
