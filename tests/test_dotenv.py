"""Provider credentials in `.env` reach the provider; the environment wins over the file."""

from __future__ import annotations

from pathlib import Path

from ksi_common.client import KsiClient
from tests.stub_openai import StubOpenAI
from tests.test_crash import DaemonProcess, daemon_env


async def _ask(daemon: DaemonProcess) -> None:
    async with KsiClient(daemon.socket) as client:
        ack = await client.request("completion:async", {"prompt": "hi"})
        await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 30})


async def test_daemon_loads_provider_keys_from_dot_env(short_tmp: Path) -> None:
    (short_tmp / ".env").write_text("OPENAI_API_KEY=sk-from-dotenv\n")
    async with StubOpenAI() as stub:
        env = daemon_env(stub.api_base)
        del env["OPENAI_API_KEY"]
        daemon = DaemonProcess(short_tmp, env)
        await daemon.start(litellm=False)
        try:
            await _ask(daemon)
        finally:
            await daemon.stop()
        assert stub.headers[-1]["Authorization"] == "Bearer sk-from-dotenv"

        daemon = DaemonProcess(short_tmp, daemon_env(stub.api_base, OPENAI_API_KEY="sk-from-env"))
        await daemon.start(litellm=False)
        try:
            await _ask(daemon)
        finally:
            await daemon.stop()
        assert stub.headers[-1]["Authorization"] == "Bearer sk-from-env"
    assert "sk-from-dotenv" not in (short_tmp / "var/logs/daemon/daemon.log").read_text()
