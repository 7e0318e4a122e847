"""Shapes the original KSI daemon's own client sends, accepted beside today's fields."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ksi_common.client import KsiClient
from ksi_common.errors import KsiError
from ksi_daemon.daemon import Daemon
from tests.conftest import complete, running_daemon, stub_settings


async def test_monitor_subscribe_with_client_id_and_event_patterns(daemon: Daemon, client: KsiClient) -> None:
    reply = await client.request("monitor:subscribe", {"client_id": "old-client", "event_patterns": ["agent:*"]})
    assert reply["client_id"] == "old-client"
    assert reply["event_patterns"] == reply["patterns"] == ["agent:*"]
    assert reply["status"] == "subscribed" and reply["subscription_id"]
    async with KsiClient(daemon.settings.socket) as other:
        await other.request("agent:spawn", {"agent_id": "watched", "model": "echo/x"})
    pushed = await client.next_push(timeout=10)
    assert pushed is not None and pushed["event"].startswith("agent:")
    with pytest.raises(KsiError) as refused:
        await client.request("monitor:subscribe", {"client_id": "c", "event_patterns": ["ag*nt"]})
    assert refused.value.code == "validation_error"


async def test_send_message_as_a_role_content_object(client: KsiClient) -> None:
    await client.request("agent:spawn", {"agent_id": "olda", "model": "echo/old"})
    reply = await client.request("agent:send_message", {"agent_id": "olda", "wait": 30,
                                                        "message": {"role": "user", "content": "hello object"}})
    assert "You said: hello object" in reply["content"]
    plain = await client.request("agent:send_message", {"agent_id": "olda", "message": "hello text", "wait": 30})
    assert "Earlier user inputs: hello object" in plain["content"]
    for bad in ({"role": "assistant", "content": "x"}, {"role": "user"}, {"content": "  "}):
        with pytest.raises(KsiError) as refused:
            await client.request("agent:send_message", {"agent_id": "olda", "message": bad})
        assert refused.value.code == "validation_error"


async def test_spawn_with_component_names_the_profile(client: KsiClient) -> None:
    spawned = await client.request("agent:spawn", {"agent_id": "comp", "component": "assistant", "model": "echo/c"})
    info = await client.request("agent:info", {"agent_id": spawned["agent_id"]})
    assert info["profile"] == "assistant"
    with pytest.raises(KsiError) as missing:
        await client.request("agent:spawn", {"agent_id": "comp2", "component": "components/core/base_agent"})
    assert missing.value.code == "profile_not_found", missing.value.message
    with pytest.raises(KsiError) as missing:
        await client.request("agent:spawn", {"agent_id": "comp3", "component": "no_such_profile"})
    assert missing.value.code == "profile_not_found"
    listed = await client.request("agent:list", {})
    assert "comp3" not in [a["agent_id"] for a in listed["agents"]]


async def test_discover_accepts_a_level(client: KsiClient) -> None:
    reply = await client.request("system:discover", {"level": "namespace"})
    assert "system:health" in reply["events"]


async def test_finished_requests_answer_status_after_a_clean_restart(short_tmp: Path, stub: Any) -> None:
    from tests.stub_openai import Reply

    stub.enqueue(Reply(status=400, body='{"error": {"message": "bad request"}}'))
    async with running_daemon(short_tmp, **stub_settings(stub)) as daemon, KsiClient(daemon.settings.socket) as client:
        failed = await client.request("completion:async", {"prompt": "fails"})
        with pytest.raises(KsiError):
            await client.request("completion:wait", {"request_id": failed["request_id"], "timeout": 30})
        done = await complete(client, prompt="works")
    async with running_daemon(short_tmp, **stub_settings(stub)) as daemon, KsiClient(daemon.settings.socket) as client:
        status = await client.request("completion:status", {"request_id": done["request_id"]})
        assert (status["status"], status["response_id"], status["conversation_id"]) == (
            "done", done["response_id"], done["conversation_id"])
        # completion:wait answers with the result data itself, rebuilt from what was stored
        waited = await client.request("completion:wait", {"request_id": done["request_id"], "timeout": 0})
        assert (waited["response_id"], waited["content"]) == (done["response_id"], done["content"])
        status = await client.request("completion:status", {"request_id": failed["request_id"]})
        assert (status["status"], status["reason"]) == ("failed", "provider_error")
        with pytest.raises(KsiError) as again:
            await client.request("completion:wait", {"request_id": failed["request_id"], "timeout": 1})
        assert again.value.code == "provider_error"
        with pytest.raises(KsiError) as unknown:
            await client.request("completion:status", {"request_id": "req-never"})
        assert unknown.value.code == "request_not_found"
