"""The Conversations door adds items with one service event: `POST /v1/conversations` with items
(its exchanges, the items waiting for a reply and the metadata) and `POST /v1/conversations/{id}/items`
(exchanges and waiting items) are written whole or not at all, on both backends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from ksi_daemon.context import EventContext
from tests.conftest import HttpDaemon, running_http_daemon, stub_settings
from tests.stored import stored_snapshot
from tests.stub_openai import StubOpenAI

pytestmark = pytest.mark.backends


def user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": text}


def assistant(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "assistant", "content": text}


def changes_of(http: HttpDaemon) -> list[tuple[str, str]]:
    """Every `conversation:changed` the daemon emits from now on: (conversation, change)."""
    seen: list[tuple[str, str]] = []
    http.daemon.router.listen("conversation:changed",
                              lambda _event, data, _context: seen.append((data["conversation_id"], data["change"])))
    return seen


async def test_a_conversation_created_with_items_and_metadata_is_one_write(
        short_tmp: Path, stub: StubOpenAI, backend: dict[str, Any]) -> None:
    async with running_http_daemon(short_tmp, **stub_settings(stub), **backend) as http, \
            httpx.AsyncClient(base_url=http.base_url, headers={"Authorization": f"Bearer {http.token}"}) as api:
        seen = changes_of(http)
        reply = await api.post("/v1/conversations", json={
            "items": [user("q1"), assistant("a1"), user("waiting 1"), user("waiting 2")], "metadata": {"app": "x"}})
        assert reply.status_code == 200, reply.text
        conversation_id = reply.json()["id"]
        assert reply.json()["metadata"] == {"app": "x"}
        assert seen == [(conversation_id, "created")]  # one event, not import, pend and update
        shown = await http.daemon.router.request("conversation:show", {"conversation_id": conversation_id},
                                                 EventContext.root())
        assert [e["reply"]["content"] for e in shown["exchanges"]] == ["a1"]
        assert [p["content"] for p in shown["conversation"]["pending_input"]] == ["waiting 1", "waiting 2"]


async def test_items_refused_after_good_ones_leave_the_conversation_as_it_was(
        short_tmp: Path, stub: StubOpenAI, backend: dict[str, Any]) -> None:
    async with running_http_daemon(short_tmp, **stub_settings(stub), **backend) as http, \
            httpx.AsyncClient(base_url=http.base_url, headers={"Authorization": f"Bearer {http.token}"}) as api:
        made = await api.post("/v1/conversations", json={"items": [user("q0"), assistant("a0")]})
        conversation_id = made.json()["id"]
        full = await api.post(f"/v1/conversations/{conversation_id}/items",
                              json={"items": [user(f"waiting {i}") for i in range(1000)]})
        assert full.status_code == 200, full.text
        before = await stored_snapshot(http.daemon.settings)
        seen = changes_of(http)
        # a good exchange, then one waiting item more than the conversation may hold
        refused = await api.post(f"/v1/conversations/{conversation_id}/items",
                                 json={"items": [user("q1"), assistant("a1"), user("one too many")]})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "validation_error", refused.text
        assert refused.json()["error"]["param"] == "items"
        assert await stored_snapshot(http.daemon.settings) == before and seen == []
