"""The HTTP front's bearer token: the explicit setting, else one generated once into the var dir."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from ksi_common.layout import VarLayout


def load_or_create(layout: VarLayout) -> str:
    """The token stored in the var dir, created (mode 0600) when there is none yet."""
    path = layout.http_token_file
    existing = _read(path)
    if existing:
        return existing
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    token = f"ksi-{secrets.token_urlsafe(32)}"
    try:
        # O_EXCL: when two processes race, the second one reads what the first one wrote
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return _read(path) or token
    with os.fdopen(fd, "w") as handle:
        handle.write(token + "\n")
    return token


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return ""
