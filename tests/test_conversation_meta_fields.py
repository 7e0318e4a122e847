"""The domain concepts a conversation's metadata once kept untyped in `extra` (scope, fork digest,
what an import continues and came from, compaction's tally, other tools' ids, pending input) are typed fields:
a record an older daemon wrote reads into them on both backends, and a record written now keeps
the same shape under `extra`, which the `ksi` readers and export files read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from ksi_common.reading import open_reader
from ksi_daemon.storage.backends import build_storage
from ksi_daemon.storage.models import CompactionTally, ConversationMeta, PendingInput
from tests.conftest import make_settings

pytestmark = pytest.mark.backends

OLD_EXTRA = {
    "scope": {"user": "u-1", "agent_id": "ag"},
    "fork_digest": "d" * 64,
    "continues": {"conversation_id": "conv-a", "exchange": 3},
    "imported_from": "conv-src", "imported_at": "2026-01-01T00:00:00Z", "imported_models": ["openai/gpt-x"],
    "compaction": {"summaries": 2, "covered": 9, "cost": 0.5},
    "external_ids": {"llm": "01abc"},
    "pending_input": [{"id": "pend-1", "content": "still there?", "ts": "2026-01-01T00:00:01Z"},
                      {"id": "pend-2", "content": "42", "ts": "2026-01-01T00:00:02Z",
                       "item": {"type": "function_call_output", "call_id": "call-1", "output": "42"}}],
    "metadata": {"team": "blue"},
}


async def write_old_record(settings: Any, record: dict[str, Any]) -> None:
    """The record as an older daemon stored it, written past the store (a file, or a row)."""
    if settings.database_url is None:
        path = settings.layout.conversation_meta_dir / f"{record['conversation_id']}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(orjson.dumps(record))
        return
    import asyncpg

    connection = await asyncpg.connect(settings.database_url.get_secret_value())
    try:
        await connection.execute("INSERT INTO ksi_conversations (conversation_id, meta, last_activity) "
                                 "VALUES ($1, $2::text::json, $3)", record["conversation_id"],
                                 orjson.dumps(record).decode(), record["last_activity"])
    finally:
        await connection.close()


async def test_an_old_record_reads_into_the_typed_fields_and_is_written_back_alike(
        short_tmp: Path, backend: dict[str, Any]) -> None:
    settings = make_settings(short_tmp, **backend)
    storage = build_storage(settings)
    await storage.open()
    try:
        old = {"v": 1, "conversation_id": "old", "created": "2026-01-01T00:00:00Z",
               "last_activity": "2026-01-01T00:00:00Z", "extra": {**OLD_EXTRA, "scope": {"user": 7}}}
        await write_old_record(settings, {**old, "conversation_id": "bad-scope"})
        await write_old_record(settings, {**old, "extra": OLD_EXTRA})
        meta = await storage.conversations.load_meta("old")
        assert meta is not None
        assert meta.scope == {"user": "u-1", "agent_id": "ag"} and meta.fork_digest == "d" * 64
        assert meta.continues == {"conversation_id": "conv-a", "exchange": 3}
        assert (meta.imported_from, meta.imported_models) == ("conv-src", ["openai/gpt-x"])
        assert meta.compaction == CompactionTally(summaries=2, covered=9, cost=0.5)
        assert meta.external_ids == {"llm": "01abc"} and meta.extra == {"metadata": {"team": "blue"}}
        assert meta.pending_input == [
            PendingInput(id="pend-1", content="still there?", ts="2026-01-01T00:00:01Z"),
            PendingInput(id="pend-2", content="42", ts="2026-01-01T00:00:02Z",
                         item={"type": "function_call_output", "call_id": "call-1", "output": "42"})]
        # a malformed value is not a field: it stays where it was, read as before (ignored)
        bad = await storage.conversations.load_meta("bad-scope")
        assert bad is not None and bad.scope is None and bad.extra["scope"] == {"user": 7}

        tallied = meta.compaction.added(12, 0.25, fallback=True)
        await storage.conversations.save_meta(meta.model_copy(update={"compaction": tallied, "title": "t"}))
        reader = open_reader(settings.storage, settings.layout,
                             settings.database_url.get_secret_value() if settings.database_url else None)
        try:
            [stored] = await reader.metas(["old"])
        finally:
            await reader.aclose()
        assert stored is not None and stored["title"] == "t"
        assert stored["extra"] == {**OLD_EXTRA, "compaction": {"summaries": 3, "covered": 12, "cost": 0.75,
                                                               "fallbacks": 1}}
        assert not set(stored) & {"scope", "fork_digest", "compaction", "external_ids", "pending_input"}
    finally:
        await storage.close()


def test_a_new_record_without_the_concepts_has_none_of_them_in_extra() -> None:
    record = ConversationMeta(conversation_id="c", extra={"metadata": {"k": "v"}}).model_dump(mode="json")
    assert record["extra"] == {"metadata": {"k": "v"}}
    assert ConversationMeta.model_validate(record) == ConversationMeta(conversation_id="c",
                                                                       extra={"metadata": {"k": "v"}},
                                                                       created=record["created"],
                                                                       last_activity=record["last_activity"])


def test_a_malformed_pending_entry_stays_in_extra_and_none_waits() -> None:
    meta = ConversationMeta.model_validate({"conversation_id": "c", "extra": {"pending_input": [{"content": "x"}]}})
    assert meta.pending_input is None and meta.extra == {"pending_input": [{"content": "x"}]}
    cleared = ConversationMeta(conversation_id="c", pending_input=[]).model_dump(mode="json")
    assert cleared["extra"] == {}  # none waits: nothing stored, as when the last pending entry was taken
