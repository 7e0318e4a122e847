"""Chromium for the console tests: the distribution's browser, installed by the test session when
it is missing and the session may install it (root with apt-get). Never downloaded by Playwright:
the registries are the only network a test machine reaches."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from filelock import FileLock

CHROMIUM = Path("/usr/bin/chromium")
PACKAGE = "chromium"
INSTALL_TIMEOUT = 900.0  # seconds: the browser and its libraries on a slow mirror


class BrowserMissing(RuntimeError):
    pass


def chromium() -> str:
    """The browser's path, installing the package first when it is missing (one installer at a time)."""
    if CHROMIUM.exists():
        return str(CHROMIUM)
    with FileLock(str(Path(tempfile.gettempdir()) / "ksi-test-chromium.lock")):
        if not CHROMIUM.exists():  # another worker may have installed it while this one waited
            _install()
    return str(CHROMIUM)


def _install() -> None:
    apt_get = shutil.which("apt-get")
    if os.geteuid() != 0 or apt_get is None:
        lacking = "not root" if os.geteuid() != 0 else "no apt-get on this machine"
        raise BrowserMissing(f"the console tests need Chromium at {CHROMIUM} and cannot install it ({lacking}): "
                             f"install the distribution's '{PACKAGE}' package (apt-get install {PACKAGE}) as root")
    environment = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    wait = ["-o", "DPkg::Lock::Timeout=600"]  # another installer on the machine holds the lock: wait for it
    for command in ([apt_get, *wait, "update", "-q"], [apt_get, *wait, "install", "-y", "-q", PACKAGE]):
        done = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=INSTALL_TIMEOUT)
        if done.returncode != 0:
            raise BrowserMissing(f"installing Chromium failed: {' '.join(command)} exited {done.returncode}: "
                                 f"{done.stderr.strip()[-1000:]}")
    if not CHROMIUM.exists():
        raise BrowserMissing(f"the '{PACKAGE}' package installed no {CHROMIUM}")
