"""node_modules for third-party clients published on npm (CLIs and JS SDKs), pinned.

Made once and kept under the user's cache directory, keyed by the pinned packages, built in a
temporary directory and renamed into place under a file lock, like the client virtualenvs: test
workers in parallel share one build, and an interrupted build is never taken for a finished one.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.client_venvs import cache_root


def node_root() -> Path:
    return cache_root().parent / "node"


def client_node_modules(packages: tuple[str, ...]) -> Path:
    """A directory whose node_modules holds `packages` (each `name@version`), made on first use."""
    key = hashlib.sha256("\n".join(sorted(packages)).encode()).hexdigest()[:16]
    home = node_root() / key
    if (home / "ready").exists():
        return home
    home.parent.mkdir(parents=True, exist_ok=True)
    with open(home.parent / f"{key}.lock", "wb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (home / "ready").exists():
            _build(home, key, packages)
    return home


def _build(home: Path, key: str, packages: tuple[str, ...]) -> None:
    building = Path(tempfile.mkdtemp(prefix=f"{key}.", dir=home.parent))
    try:
        (building / "package.json").write_text(json.dumps({"name": "ksi-test-clients", "private": True}))
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--loglevel=error", *packages],
                       cwd=building, check=True, env={**os.environ, "npm_config_update_notifier": "false"})
        (building / "ready").write_text("\n".join(packages) + "\n")
        shutil.rmtree(home, ignore_errors=True)  # a half-made one left by an older interrupted run
        building.rename(home)
    finally:
        shutil.rmtree(building, ignore_errors=True)


def node_bin(home: Path, name: str) -> Path:
    """The executable an npm package installed under `home` puts in node_modules/.bin."""
    return home / "node_modules" / ".bin" / name
