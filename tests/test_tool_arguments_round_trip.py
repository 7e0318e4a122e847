"""A model that answers a tool call with arguments that are not JSON: the daemon stores them as
the model sent them, and the conversation's export imports again and exports the same, so a
backup of whatever the daemon stored can be restored. Both storage backends."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ksi_common.client import KsiClient
from ksi_daemon.daemon import Daemon
from tests.conftest import complete, connected
from tests.stub_openai import Reply, StubOpenAI

pytestmark = pytest.mark.backends

BROKEN = "{city: Oslo"  # cut off or unquoted: what a small model may emit


def exchanges_of(export: dict[str, Any]) -> list[dict[str, Any]]:
    document = json.loads(export["content"])
    return [{"input": e["input"], "output": e["output"]} for e in document["exchanges"]]


async def exported(client: KsiClient, conversation_id: str) -> dict[str, Any]:
    return await client.request("conversation:export", {"conversation_id": conversation_id, "format": "json"})


async def test_arguments_that_are_not_json_survive_export_import_export(
        stub_daemon: Daemon, stub: StubOpenAI) -> None:
    async with connected(stub_daemon) as client:
        await round_trip(client, stub)


async def round_trip(client: KsiClient, stub: StubOpenAI) -> None:
    stub.enqueue(Reply(text="", calls=[{"name": "weather", "arguments": BROKEN, "id": "call_1"}]))
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    result = await complete(client, prompt="weather in Oslo?", conversation_id="t", create=True,
                            tools=tools)
    call = next(item for item in result["output"] if item["type"] == "function_call")
    assert call["arguments"] == BROKEN  # stored as the model sent it
    first = await exported(client, "t")
    await client.request("conversation:import", {"data": first["content"], "new_id": "restored"})
    second = await exported(client, "restored")
    assert exchanges_of(second) == exchanges_of(first)
