"""The settings a daemon was given by its start (flags, the environment, `.env`), recorded in its
run directory so `ksi daemon restart` can start the next daemon with them from any shell.

Secrets are never written here (nor anywhere else KSI writes by itself): the record names the
ones the start was given, so a restart from a shell that lacks one can say so before it stops
anything. Only the configuration file, which the user writes and keeps owner-only, holds them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ksi_common.privacy import FILE_MODE

VERSION = 1


@dataclass(frozen=True)
class KeptSettings:
    values: dict[str, Any] = field(default_factory=dict)  # JSON-ready, by setting name
    secrets: tuple[str, ...] = ()  # names of the secrets the start was given, never their values


def read_kept(path: Path) -> KeptSettings:
    """The record, empty when there is none or it cannot be read."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return KeptSettings()
    if not isinstance(record, dict):
        return KeptSettings()
    values, secrets = record.get("settings"), record.get("secrets")
    return KeptSettings(values if isinstance(values, dict) else {},
                        tuple(secrets) if isinstance(secrets, list) else ())


def write_kept(path: Path, kept: KeptSettings) -> None:
    """Replace the record (owner-only)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, FILE_MODE)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump({"v": VERSION, "settings": kept.values, "secrets": list(kept.secrets)}, handle)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def forget_kept(path: Path, name: str) -> bool:
    """Drop one setting from the record (the file's value applies at the next restart); True when it was there."""
    kept = read_kept(path)
    if name not in kept.values and name not in kept.secrets:
        return False
    values = {key: value for key, value in kept.values.items() if key != name}
    write_kept(path, KeptSettings(values, tuple(s for s in kept.secrets if s != name)))
    return True
