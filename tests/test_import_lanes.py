"""A large import does not hold up other requests: while one of 5,000 exchanges is being written,
a small import and a chat completion that carries its history (a stateless client's every turn)
are answered; the large one is then whole, and a large one that fails leaves nothing.

JSONL writes an import's files in batches with one sync each; the test catches it while its
response files appear. PostgreSQL writes it in one transaction; the test holds the new id's row
(as another daemon creating the same id would), so the import waits inside its transaction."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from ksi_common.errors import KsiError
from ksi_common.settings import Settings
from tests.conftest import HttpDaemon, connected, running_http_daemon, stub_settings
from tests.stored import names, stored_index, stored_snapshot

pytestmark = pytest.mark.backends

LARGE = 5000


def document(answers: int, tag: str) -> dict[str, Any]:
    exchanges = [{"inputs": [{"type": "user", "content": f"{tag} q{k}"}],
                  "reply": {"content": f"{tag} a{k}", "model": "echo/x"}, "model": "echo/x"} for k in range(answers)]
    return {"v": 1, "format": "ksi.conversation", "conversation": {"title": f"{tag}: {answers} answers"},
            "exchanges": exchanges}


@pytest.fixture
async def http_store(short_tmp: Path, stub: Any, backend: dict[str, Any]) -> AsyncIterator[HttpDaemon]:
    async with running_http_daemon(short_tmp, **stub_settings(stub), **backend) as running:
        yield running


class ImportWatch:
    """Tells when an import of `conversation_id` is under way and not yet committed, whatever
    the backend; on PostgreSQL it holds the id's row until `let_go` (commit: the id is taken)."""

    def __init__(self, settings: Settings, conversation_id: str) -> None:
        self.settings = settings
        self.conversation_id = conversation_id
        self.conn: asyncpg.Connection | None = None
        self.transaction: Any = None

    async def hold(self) -> None:
        if self.settings.storage == "jsonl":
            return
        assert self.settings.database_url is not None
        self.conn = await asyncpg.connect(self.settings.database_url.get_secret_value())
        self.transaction = self.conn.transaction()
        await self.transaction.start()
        await self.conn.execute(
            "INSERT INTO ksi_conversations (conversation_id, meta, base, last_activity) VALUES ($1, $2::json, 0, $3)",
            self.conversation_id, '{"conversation_id": "%s", "title": "taken meanwhile"}' % self.conversation_id,
            "2026-01-01T00:00:00Z")

    async def under_way(self, task: asyncio.Task[Any]) -> None:
        """Until the import is writing: its first response files (JSONL) or its transaction waiting
        for the held row (PostgreSQL)."""
        while not task.done():
            if self.conn is not None:
                # from the connection holding the row, statistics are a snapshot taken once per transaction
                await self.conn.execute("SELECT pg_stat_clear_snapshot()")
                waiting = await self.conn.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock' AND query LIKE '%INSERT INTO ksi_conversations%'")
                if waiting:
                    return
            elif len(names(await stored_snapshot(self.settings), "logs/responses/")) > 10:
                return
            await asyncio.sleep(0.005)
        raise AssertionError(f"the import ended before it was seen under way: {task.result()}")

    async def let_go(self, commit: bool) -> None:
        if self.conn is not None:
            await (self.transaction.commit() if commit else self.transaction.rollback())
            await self.conn.close()
            self.conn = None


async def chat_with_history(daemon: HttpDaemon) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=daemon.base_url, timeout=60,
                                 headers={"Authorization": f"Bearer {daemon.token}"}) as http:
        reply = await http.post("/v1/chat/completions", json={"model": "openai/stub-model", "messages": [
            {"role": "user", "content": "first question"}, {"role": "assistant", "content": "first answer"},
            {"role": "user", "content": "second question"}]})
    assert reply.status_code == 200, reply.text
    return {"conversation_id": reply.headers["X-KSI-Conversation-Id"], **reply.json()}


async def test_a_small_import_and_a_history_request_finish_while_a_large_import_writes(
        http_store: HttpDaemon) -> None:
    settings = http_store.daemon.settings
    watch = ImportWatch(settings, "large")
    finished: list[str] = []
    await chat_with_history(http_store)  # litellm loaded (seconds, once) before the race
    async with connected(http_store.daemon) as client:
        await watch.hold()
        large = asyncio.create_task(client.request("conversation:import",
                                                   {"data": document(LARGE, "large"), "new_id": "large"}))
        large.add_done_callback(lambda _task: finished.append("large import"))
        try:
            await watch.under_way(large)
            small = await client.request("conversation:import", {"data": document(3, "small")})
            finished.append("small import")
            chat = await chat_with_history(http_store)
            finished.append("chat with history")
        finally:
            await watch.let_go(commit=False)
        imported = await large
        assert finished == ["small import", "chat with history", "large import"]
        assert small["exchanges"] == 3 and chat["choices"][0]["message"]["content"] == "stub answer to: second question"
        assert imported["exchanges"] == LARGE
        shown = await client.request("conversation:show", {"conversation_id": "large", "offset": LARGE - 2})
    assert shown["total_exchanges"] == LARGE and shown["conversation"]["title"] == "large: 5000 answers"
    assert [x["reply"]["content"] for x in shown["exchanges"]] == [f"large a{LARGE - 2}", f"large a{LARGE - 1}"]
    index = await stored_index(http_store.daemon, "large")
    assert [line["n"] for line in index] == list(range(1, LARGE + 1))
    assert len({line["response_id"] for line in index}) == LARGE


async def test_a_large_import_whose_id_is_taken_meanwhile_leaves_nothing(http_store: HttpDaemon) -> None:
    settings = http_store.daemon.settings
    watch = ImportWatch(settings, "large")
    async with connected(http_store.daemon) as client:
        source = await client.request("conversation:import", {"data": document(2, "source"), "new_id": "source"})
        assert source["exchanges"] == 2
        before = await stored_snapshot(settings)
        await watch.hold()
        large = asyncio.create_task(client.request("conversation:import",
                                                   {"data": document(LARGE, "large"), "new_id": "large"}))
        try:
            await watch.under_way(large)
            if settings.storage == "jsonl":  # another creator takes the id while the import writes
                await client.request("conversation:fork", {"conversation_id": "source", "new_id": "large", "at": 0})
        finally:
            await watch.let_go(commit=True)
        with pytest.raises(KsiError) as caught:
            await large
        assert caught.value.code == "conversation_exists"
        after = await stored_snapshot(settings)
        shown = await client.request("conversation:show", {"conversation_id": "large"})
    # of the import nothing stays (no response, no hidden index): only the other creator's metadata
    assert sorted(set(after) - set(before)) == ["state/conversations/large.json"]
    assert all(after[name] == before[name] for name in before)
    assert shown["total_exchanges"] == 0
