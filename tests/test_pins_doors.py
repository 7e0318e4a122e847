"""Pins through every door: the `ksi` CLI, an HTTP metadata field, an MCP tool argument; each
calls `conversation:pin` / `unpin` and shows the same pins. (The console's button: test_console.)"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import httpx
import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from tests.conftest import HttpDaemon, complete, connected
from tests.test_mcp_stdio import call, refused


async def ksi(*args: str) -> tuple[int, dict[str, Any]]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "ksi_cli", *args, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await process.communicate()
    return process.returncode or 0, json.loads(out or err)


async def test_pins_through_the_cli_http_and_mcp(http_daemon: HttpDaemon) -> None:
    daemon = http_daemon.daemon
    where = ["--socket", str(daemon.settings.socket), "--var-dir", str(daemon.settings.var_dir), "--json"]
    async with connected(daemon) as client:
        for turn in range(3):
            await complete(client, prompt=f"turn {turn}", conversation_id="doors", create=True)

        async def pins() -> list[int]:
            return (await client.request("conversation:show", {"conversation_id": "doors"}))["conversation"]["pins"]

        code, reply = await ksi("conversation", "pin", "doors", "1", "3", *where)
        assert code == 0 and reply["pins"] == [1, 3] and await pins() == [1, 3]
        code, reply = await ksi("conversation", "unpin", "doors", "3", *where)
        assert code == 0 and reply["pins"] == [1] and await pins() == [1]
        code, reply = await ksi("conversation", "pin", "doors", "9", *where)
        assert code != 0 and reply["error"]["code"] == "validation_error" and await pins() == [1]

        headers = {"Authorization": f"Bearer {http_daemon.token}"}
        async with httpx.AsyncClient(base_url=http_daemon.base_url, headers=headers, timeout=30) as http:
            updated = await http.post("/v1/conversations/doors", json={"metadata": {"ksi_pins": "2", "topic": "x"}})
            assert updated.status_code == 200, updated.text
            assert updated.json()["metadata"] == {"ksi_pins": "2", "topic": "x"} and await pins() == [2]
            bad = await http.post("/v1/conversations/doors", json={"metadata": {"ksi_pins": "two"}})
            assert bad.status_code == 400 and bad.json()["error"]["code"] == "validation_error"
            assert await pins() == [2]
            # one event: a pin refused by the service leaves the other metadata sent with it unchanged too
            missing = await http.post("/v1/conversations/doors", json={"metadata": {"ksi_pins": "2,9", "topic": "y"}})
            assert missing.status_code == 400 and missing.json()["error"]["code"] == "validation_error"
            assert await pins() == [2]
            shown = (await http.get("/v1/conversations/doors")).json()
            assert shown["metadata"] == {"ksi_pins": "2", "topic": "x"}

        async with httpx2.AsyncClient(headers=headers, timeout=30) as http2, \
                Client(streamable_http_client(f"{http_daemon.base_url}/mcp", http_client=http2)) as mcp:
            await call(mcp, "conversation", continuation_id="doors", pin=[1])
            assert await pins() == [1, 2]
            await call(mcp, "conversation", continuation_id="doors", unpin=[2])
            assert await pins() == [1]
            await refused(mcp, "validation_error", "conversation", continuation_id="doors", pin=["one"])
            assert await pins() == [1]
