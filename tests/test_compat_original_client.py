"""Shapes the original KSI daemon's own client sends, accepted beside today's fields."""

from __future__ import annotations

import pytest

from ksi_common.client import KsiClient
from ksi_common.errors import KsiError
from ksi_daemon.daemon import Daemon


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
