"""A long-lived reader lists conversations from what it read before, and still sees every change."""

from __future__ import annotations

from pathlib import Path

from ksi_common.reading import JsonlReader
from ksi_common.transcripts import Transcripts
from ksi_daemon.storage.jsonl.conversations import JsonlConversations
from ksi_daemon.storage.models import ConversationMeta
from tests.conftest import make_settings


async def test_listing_follows_changes_made_since_the_last_listing(short_tmp: Path) -> None:
    layout = make_settings(short_tmp).layout
    store = JsonlConversations(layout, fsync=False)
    reader = Transcripts(JsonlReader(layout))
    for number in range(3):
        await store.save_meta(ConversationMeta(conversation_id=f"c{number}", last_activity=f"2026-01-0{number + 1}T00:00:00Z"))
    items, total = await reader.listing(limit=10)
    assert total == 3 and [i["conversation_id"] for i in items] == ["c2", "c1", "c0"]

    await store.save_meta(ConversationMeta(conversation_id="c0", title="renamed", last_activity="2026-02-01T00:00:00Z",
                                     status="archived"))
    await store.save_meta(ConversationMeta(conversation_id="c3", last_activity="2026-01-04T00:00:00Z", tags=["new"]))
    layout.meta_file("c1").unlink()
    items, total = await reader.listing(limit=10)
    assert [i["conversation_id"] for i in items] == ["c0", "c3", "c2"] and total == 3
    assert items[0]["title"] == "renamed"
    assert [i["conversation_id"] for i in (await reader.listing(status="archived"))[0]] == ["c0"]
    assert [i["conversation_id"] for i in (await reader.listing(tag="new"))[0]] == ["c3"]
    assert await reader.listing(limit=1, offset=1) == ([items[1]], 3)
