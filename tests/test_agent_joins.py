"""An agent joining another conversation speaks under its profile's system prompt; profiles of
KSI_PROFILES_DIR join the shipped ones."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ksi_common.client import KsiClient
from tests.conftest import complete, running_daemon, stub_settings


async def test_an_agent_in_another_conversation_brings_its_system_prompt(short_tmp: Path, stub: Any) -> None:
    profiles = short_tmp / "profiles"
    profiles.mkdir()
    (profiles / "critic.yaml").write_text("system: You are the critic.\n")
    (profiles / "assistant.yaml").write_text("system: A local assistant replaces the shipped one.\n")
    async with running_daemon(short_tmp, **stub_settings(stub, profiles_dir=profiles)) as daemon, \
            KsiClient(daemon.settings.socket) as client:
        names = {p["name"] for p in (await client.request("agent:profiles"))["profiles"]}
        assert {"critic", "assistant", "coordinator", "reviewer"} <= names
        spawned = await client.request("agent:spawn", {"agent_id": "helper", "profile": "assistant"})
        info = await client.request("agent:info", {"agent_id": spawned["agent_id"]})
        assert info["system"] == "A local assistant replaces the shipped one."

        first = await complete(client, prompt="draft", system="You are the author.")
        await client.request("agent:spawn", {"agent_id": "critic-1", "profile": "critic"})
        await complete(client, prompt="judge it", agent_id="critic-1", conversation_id=first["conversation_id"])
        sent = stub.messages()
        assert sent[0]["role"] == "system" and sent[0]["content"].startswith("You are the critic.")
        assert [m["content"] for m in sent[1:]] == ["draft", "stub answer to: draft", "judge it"]
        # the conversation keeps its own system prompt for the next turn
        await complete(client, prompt="and now?", conversation_id=first["conversation_id"])
        assert stub.messages()[0]["content"].startswith("You are the author.")
