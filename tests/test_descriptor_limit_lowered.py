"""A daemon whose descriptor limit is lowered while it runs (prlimit on its process): a request that
needs a file it can no longer open is answered `too_many_connections`, never `internal_error`,
nothing is written for it, and once the limit is raised again the daemon serves as before. JSONL:
the files it must open are the var dir's (on PostgreSQL the pool's connections are already open)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from ksi_common.client import KsiClient
from tests.conftest import complete
from tests.test_crash import DaemonProcess, daemon_env


def set_soft_limit(pid: int, limit: int) -> None:
    subprocess.run(["prlimit", f"--pid={pid}", f"--nofile={limit}:"], check=True)  # the hard limit stays


async def test_a_lowered_descriptor_limit_is_too_many_connections_and_the_daemon_serves_on(short_tmp: Path) -> None:
    daemon = DaemonProcess(short_tmp, daemon_env("http://127.0.0.1:9", KSI_DEFAULT_MODEL="echo/x",
                                                 KSI_LITELLM_PRELOAD="false"))
    await daemon.start(wait=120, litellm=False)
    try:
        assert daemon.process is not None
        pid = daemon.process.pid
        async with KsiClient(daemon.socket) as client:
            await complete(client, prompt="warm", conversation_id="w", create=True)
            original = int(open(f"/proc/{pid}/limits").read().split("Max open files")[1].split()[0])
            set_soft_limit(pid, len(os.listdir(f"/proc/{pid}/fd")))  # not one descriptor to spare
            try:
                refused = await client.send_frame("completion:async", {"prompt": "p", "conversation_id": "n",
                                                                       "create": True})
            finally:
                set_soft_limit(pid, original)
            assert refused["error"]["code"] == "too_many_connections", refused
            assert refused["error"]["details"]["retry_after"] > 0
            assert not (daemon.var / "state" / "conversations" / "n.json").exists()
            result = await complete(client, prompt="again", conversation_id="n", create=True)
            assert "again" in result["content"]
    finally:
        daemon.kill_if_running()
