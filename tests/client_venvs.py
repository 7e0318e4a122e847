"""Virtualenvs for third-party clients whose SDK needs a newer `openai` than litellm allows.

Made once and kept under the user's cache directory (keyed by the requirements, so a new pin makes
a new one), built in a temporary directory and renamed into place, so an interrupted build is never
taken for a finished one. A client script runs there as a subprocess against a daemon of the test.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# the clients people run against an OpenAI-compatible server, pinned so a test run is reproducible
AGENT_CLIENTS = ("openai-agents==0.24.0", "langchain-openai==1.7.4")


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ksi-tests" / "venvs"


def client_python(requirements: tuple[str, ...]) -> Path:
    """The python of a virtualenv holding `requirements`, made on first use."""
    key = hashlib.sha256("\n".join(sorted(requirements)).encode()).hexdigest()[:16]
    home = cache_root() / key
    python = home / "bin" / "python"
    if (home / "ready").exists():
        return python
    home.parent.mkdir(parents=True, exist_ok=True)
    # test workers in parallel each want it: one builds, the others wait and take it
    with open(home.parent / f"{key}.lock", "wb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (home / "ready").exists():
            _build(home, key, requirements)
    return python


def _build(home: Path, key: str, requirements: tuple[str, ...]) -> None:
    building = Path(tempfile.mkdtemp(prefix=f"{key}.", dir=home.parent))
    try:
        subprocess.run([sys.executable, "-m", "venv", str(building)], check=True)
        # only `bin/python -m ...` is ever run: unlike the venv's scripts, it works after the move
        subprocess.run([str(building / "bin" / "python"), "-m", "pip", "install", "-q",
                        "--disable-pip-version-check", *requirements], check=True)
        (building / "ready").write_text("\n".join(requirements) + "\n")
        shutil.rmtree(home, ignore_errors=True)  # a half-made one left by an older interrupted run
        building.rename(home)
    finally:
        shutil.rmtree(building, ignore_errors=True)


async def run_client(python: Path, script: str, env: dict[str, str], timeout: float = 120.0) -> Any:
    """Run `script` with the client virtualenv's python; its last stdout line is JSON, returned.
    The daemon under test serves in this event loop, so the wait must not block it."""
    process = await asyncio.create_subprocess_exec(
        str(python), "-c", script, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **env})
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    if process.returncode != 0:
        raise AssertionError(f"client script failed ({process.returncode}):\n{err.decode()[-4000:]}")
    lines = [line for line in out.decode().splitlines() if line.strip()]
    return json.loads(lines[-1])
