"""A conversation longer than the history budget, once in memory, is not re-read from disk per turn."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ksi_common.layout import VarLayout
from ksi_common.records import IndexEntry
from ksi_daemon.services.conversations.history import build_messages, select_history
from ksi_daemon.services.conversations.memory import ConversationCache
from ksi_daemon.storage.jsonl.conversations import JsonlConversations
from ksi_daemon.storage.jsonl.responses import JsonlResponses
from ksi_daemon.storage.models import ConversationMeta

BUDGET = 1000


async def write_conversation(layout: VarLayout, conversation_id: str, exchanges: int) -> None:
    for directory in (layout.responses_dir, layout.conversations_dir, layout.conversation_meta_dir):
        directory.mkdir(parents=True, exist_ok=True)
    store = JsonlConversations(layout, fsync=False)
    await store.create(ConversationMeta(conversation_id=conversation_id))
    for n in range(1, exchanges + 1):
        response_id = f"m-{n:012x}"
        await store.append_exchange(conversation_id, IndexEntry(n=n, response_id=response_id, tokens_in=50, tokens_out=47),
                                    response=[{"v": 1, "type": "user", "content": f"question {n}"},
                                              {"v": 1, "type": "assistant", "content": f"answer {n}"}])


async def test_warm_turns_do_not_reread_the_index_tail(short_tmp: Path) -> None:
    layout = VarLayout(short_tmp / "var")
    await write_conversation(layout, "c-long", 200)  # 200 x 97 tokens, far beyond the budget
    store = JsonlConversations(layout, fsync=False)
    reads: list[int] = []
    read_tail = store.read_tail

    async def counting_read_tail(conversation_id: str, budget: int) -> Any:
        reads.append(budget)
        return await read_tail(conversation_id, budget)

    store.read_tail = counting_read_tail  # type: ignore[method-assign]
    cache = ConversationCache(store, JsonlResponses(layout, fsync=False), capacity=10)

    async def prepare(budget: int) -> list[dict[str, Any]]:
        await cache.require("c-long")
        memory = await cache.require("c-long", budget)
        history = await select_history(cache, memory, budget, 8)
        return build_messages(None, history, [{"role": "user", "content": "next"}])

    first = await prepare(BUDGET)
    assert len(first) == 1 + 2 * 10 + 1  # the omitted note, the 10 newest exchanges, the new input
    assert "190 earlier exchanges" in first[0]["content"]
    cold_reads = len(reads)
    for _ in range(5):
        assert await prepare(BUDGET) == first
        assert await prepare(BUDGET - 7) is not None  # a smaller budget is served from memory too
    assert len(reads) == cold_reads

    # a larger budget than any read so far reads the tail once more, then no more
    bigger = await prepare(BUDGET * 2)
    assert len(bigger) == 1 + 2 * 20 + 1
    assert len(reads) == cold_reads + 1
    await prepare(BUDGET * 2)
    assert len(reads) == cold_reads + 1
