"""A background response interrupted by SIGKILL: after the restart its id still names it. On one
daemon (JSONL) it is `failed` with `daemon_restart`, as the journal records it; on the pool
(PostgreSQL) the restarted daemon takes it over and finishes it. Neither answers "no such
response", for the object, its stream or a cancel."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.responses_conformance import conforming_response
from tests.stub_openai import StubOpenAI
from tests.test_crash import DaemonProcess, daemon_env

pytestmark = pytest.mark.backends

TOKEN = "ksi-test-token-crash-0123456789"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def crash_env(stub: StubOpenAI, port: int, backend: dict[str, Any]) -> dict[str, str]:
    extra = {"KSI_HTTP_ADDR": f"127.0.0.1:{port}", "KSI_HTTP_TOKEN": TOKEN, "KSI_SUMMARISER": "off"}
    if backend:
        extra.update({"KSI_STORAGE": "postgres", "KSI_DATABASE_URL": backend["database_url"],
                      "KSI_HEARTBEAT_INTERVAL": "0.25", "KSI_HEARTBEAT_TIMEOUT": "2"})
    return daemon_env(stub.api_base, **extra)


def sse_events(body: str) -> list[dict[str, Any]]:
    return [json.loads(line.removeprefix("data: ")) for line in body.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


async def test_a_background_response_killed_mid_call_is_still_named_by_its_id(
        short_tmp: Path, stub: StubOpenAI, backend: dict[str, Any]) -> None:
    port = free_port()
    daemon = DaemonProcess(short_tmp, crash_env(stub, port, backend))
    stub.model_delay["stub-slow"] = 600.0  # at the model when the daemon is killed
    base = f"http://127.0.0.1:{port}/v1"
    async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"},
                                 timeout=60) as http:
        try:
            await daemon.start(wait=120)
            created = (await http.post("/responses", json={"model": "openai/stub-slow", "input": "go",
                                                            "background": True})).json()
            async with asyncio.timeout(60):
                while not stub.requests:
                    await asyncio.sleep(0.02)
            daemon.kill()
            stub.model_delay.clear()  # a daemon that takes it over is answered at once
            await daemon.start(wait=120)
            response_id = created["id"]
            if not backend:
                shown = await http.get(f"/responses/{response_id}")
                assert shown.status_code == 200, shown.text
                data = shown.json()
                conforming_response(data)
                assert data["status"] == "failed" and data["error"]["message"].startswith("daemon_restart")
                assert data["model"] == "openai/stub-slow" and data["background"] is True
                streamed = await http.get(f"/responses/{response_id}", params={"stream": "true"})
                assert streamed.status_code == 200, streamed.text
                events = sse_events(streamed.text)
                assert events[-1]["type"] == "response.failed"
                assert events[-1]["response"]["error"]["message"].startswith("daemon_restart")
                cancel = await http.post(f"/responses/{response_id}/cancel")
                assert cancel.status_code == 409, cancel.text
                assert cancel.json()["error"]["code"] == "response_not_cancellable"
                assert "failed" in cancel.json()["error"]["message"]
            else:
                async with asyncio.timeout(90):  # taken over once the killed run's heartbeat is stale
                    while True:
                        shown = await http.get(f"/responses/{response_id}")
                        assert shown.status_code == 200, shown.text  # never "no such response"
                        data = shown.json()
                        conforming_response(data)
                        if data["status"] == "completed":
                            break
                        assert data["status"] in ("queued", "in_progress"), data
                        await asyncio.sleep(0.1)
                assert data["output"][0]["content"][0]["text"]
                streamed = await http.get(f"/responses/{response_id}", params={"stream": "true"})
                assert streamed.status_code == 200, streamed.text
                assert sse_events(streamed.text)[-1]["type"] == "response.completed"
        finally:
            daemon.kill_if_running()
