"""Model names are bounded and free of control characters wherever an event takes one; an imported
document's agent ids are checked like every other id. Refused with `validation_error` naming the
field, with nothing stored, on every backend."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import httpx
import pytest

from ksi_common.client import KsiClient
from ksi_common.errors import KsiError
from ksi_common.limits import MAX_MODEL_NAME
from ksi_daemon.daemon import Daemon
from tests.conftest import HTTP_TOKEN, complete, connected, running_http_daemon
from tests.test_import_hostile import document, exchange

pytestmark = pytest.mark.backends

BAD_NAMES = {
    "half a megabyte": "echo/" + "x" * 512 * 1024,  # a whole one is past the line limit
    "one past the bound": "echo/" + "x" * (MAX_MODEL_NAME - 4),
    "a NUL": "echo/a\x00b",
    "a newline": "echo/a\nb",
    "an escape": "echo/a\x1b[31mb",
    "a C1 control": "echo/a\x9bb",
}


async def refused(client: KsiClient, event: str, data: dict[str, Any]) -> KsiError:
    with pytest.raises(KsiError) as caught:
        await client.request(event, data)
    return caught.value


async def stored(client: KsiClient) -> tuple[list[str], list[str], list[str]]:
    """Every conversation, agent and saved consortium the daemon knows."""
    conversations = await client.request("conversation:list", {"limit": 1000})
    agents = await client.request("agent:list")
    consortia = await client.request("consortium:list")
    return (sorted(c["conversation_id"] for c in conversations["conversations"]),
            sorted(a["agent_id"] for a in agents["agents"]),
            sorted(c["name"] for c in consortia["consortia"]))


@pytest.mark.parametrize("name", list(BAD_NAMES))
async def test_a_bad_model_name_is_refused_where_it_enters(daemon: Daemon, client: KsiClient, name: str) -> None:
    bad = BAD_NAMES[name]
    await complete(client, prompt="something stored before", conversation_id="kept", create=True)
    before = await stored(client)
    attempts: list[tuple[str, dict[str, Any], str]] = [
        ("completion:async", {"prompt": "hi", "model": bad}, "model"),
        ("completion:async", {"prompt": "hi", "model": bad, "conversation_id": "new-one", "create": True}, "model"),
        ("completion:async", {"prompt": "hi", "model": bad, "conversation_id": "kept"}, "model"),
        ("agent:spawn", {"agent_id": "named_badly", "model": bad, "prompt": "hi"}, "model"),
        ("consortium:save", {"name": "badly", "members": [bad], "arbiter": "echo/judge"}, "members.0.model"),
        ("consortium:save", {"name": "badly", "members": ["echo/a"], "arbiter": bad}, "arbiter"),
        ("completion:async", {"prompt": "hi", "consortium": {"members": ["echo/a"], "arbiter": bad}},
         "consortium.arbiter"),
        ("conversation:list", {"model": bad}, "model"),
    ]
    for event, data, field in attempts:
        error = await refused(client, event, data)
        assert error.code == "validation_error", (event, error.code)
        assert field in error.details["fields"], (event, error.details)
        assert len(error.message) < 2000  # the name is not echoed back whole
    assert await stored(client) == before
    history = await client.request("conversation:export", {"conversation_id": "kept"})
    assert history["exchanges"] == 1


async def test_a_name_at_the_bound_is_taken(client: KsiClient) -> None:
    longest = "echo/" + "x" * (MAX_MODEL_NAME - 5)
    result = await complete(client, prompt="hi", model=longest)
    assert result["model"] == longest


@pytest.mark.parametrize(("damage", "field"), [
    (lambda d: d["conversation"].update(agent_id="../../etc"), "data.conversation.agent_id"),
    (lambda d: d["conversation"].update(agent_id="a\x00b"), "data.conversation.agent_id"),
    (lambda d: d["conversation"].update(agent_id="x" * 10_000), "data.conversation.agent_id"),
    (lambda d: d["exchanges"][0].update(agent_id="has space"), "data.exchanges.0.agent_id"),
    (lambda d: d["exchanges"][0].update(model="echo/a\x00b"), "data.exchanges.0.model"),
    (lambda d: d["exchanges"][0]["reply"].update(model="echo/" + "x" * 5000), "data.exchanges.0.reply.model"),
])
async def test_an_imported_document_with_bad_ids_or_names_is_refused(client: KsiClient, damage: Any,
                                                                     field: str) -> None:
    good = document(exchange("one", "ONE"), agent_id="agent_1")
    before = await stored(client)
    bad = copy.deepcopy(good)
    damage(bad)
    error = await refused(client, "conversation:import", {"data": bad, "new_id": "imp"})
    assert error.code == "validation_error"
    assert field in error.details["fields"], error.details
    assert await stored(client) == before
    assert (await client.request("conversation:import", {"data": good, "new_id": "imp"}))["exchanges"] == 1


async def test_the_http_doors_refuse_a_bad_model_name(short_tmp: Path, backend: dict[str, Any]) -> None:
    async with running_http_daemon(short_tmp, **backend) as http, connected(http.daemon) as client:
        before = await stored(client)
        headers = {"Authorization": f"Bearer {HTTP_TOKEN}"}
        async with httpx.AsyncClient(base_url=http.base_url, headers=headers) as door:
            for name in ("echo/a\x00b", "echo/" + "x" * 1000):
                for path, body in (("/v1/responses", {"model": name, "input": "hi"}),
                                   ("/v1/chat/completions", {"model": name,
                                                             "messages": [{"role": "user", "content": "hi"}]})):
                    reply = await door.post(path, json=body)
                    assert reply.status_code == 400, (path, reply.text[:300])
                    assert reply.json()["error"]["code"] == "validation_error"
                    assert reply.json()["error"]["param"] == "model"
        assert await stored(client) == before
