"""Compaction's writes against the conversation's life: a summary being written when its
conversation is deleted or reset is dropped (no ghost comes back), and a summariser that ignores
its budget never has its answer stored or sent back to it. On every storage backend."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from ksi_common.doctor import check
from ksi_common.layout import VarLayout
from ksi_daemon.daemon import Daemon
from tests.conftest import complete, connected, running_daemon
from tests.stored import stored_meta, stored_reader
from tests.test_compaction import (
    FACT,
    FACT_PARTS,
    FILLER,
    SMALL,
    WRITER_AT_STUB,
    answering,
    good,
    sent_text,
    settings,
    settled,
    summariser_calls,
    turn_calls,
)

pytestmark = pytest.mark.backends


async def stored_summaries(daemon: Daemon, conversation_id: str) -> list[Any]:
    reader = stored_reader(daemon.settings)
    try:
        return list(await reader.summaries(conversation_id))
    finally:
        await reader.aclose()


async def until_the_summariser_is_called(daemon: Daemon, client: Any, stub: Any, **target: Any) -> None:
    turn = 0
    while not summariser_calls(stub):
        turn += 1
        await complete(client, model=SMALL, prompt=FACT if turn == 1 else FILLER, **target)
        await asyncio.sleep(0.02)
        assert turn < 40, "the summariser was never called"
    assert daemon.completion.compactor.health()["running"] == 1


async def test_a_summary_written_while_its_conversation_is_deleted_is_dropped(
        short_tmp: Path, stub: Any, backend: dict[str, Any]) -> None:
    stub.answer = answering(good)
    gate = stub.model_gate[WRITER_AT_STUB] = asyncio.Event()
    async with running_daemon(short_tmp, **settings(stub, **backend)) as daemon, connected(daemon) as client:
        await until_the_summariser_is_called(daemon, client, stub, conversation_id="doomed", create=True)
        await client.request("conversation:delete", {"conversation_id": "doomed"})
        gate.set()
        await settled(daemon)
        # no ghost: no metadata, no summaries, and the id is free again
        assert await stored_meta(daemon, "doomed") is None
        assert await stored_summaries(daemon, "doomed") == []
        listed = await client.request("conversation:list", {})
        assert "doomed" not in {c["conversation_id"] for c in listed["conversations"]}
        again = await complete(client, model=SMALL, prompt="hello", conversation_id="doomed", create=True)
        assert again["history"]["exchanges_total"] == 0
    if not backend:
        assert check(short_tmp / "var").ok


async def test_a_summary_written_while_its_agent_is_reset_is_dropped(
        short_tmp: Path, stub: Any, backend: dict[str, Any]) -> None:
    stub.answer = answering(good)
    gate = stub.model_gate[WRITER_AT_STUB] = asyncio.Event()
    async with running_daemon(short_tmp, **settings(stub, **backend)) as daemon, connected(daemon) as client:
        await client.request("agent:spawn", {"agent_id": "ann", "model": SMALL})
        await until_the_summariser_is_called(daemon, client, stub, conversation_id="ann")
        reset = await client.request("agent:reset", {"agent_id": "ann"})
        gate.set()
        await settled(daemon)
        fresh = await stored_meta(daemon, "ann") or {}
        assert "compaction" not in (fresh.get("extra") or {})  # the fresh conversation got nothing of the old
        assert await stored_summaries(daemon, "ann") == []
        assert await stored_summaries(daemon, reset["previous_conversation_id"]) == []  # written by no one
        assert fresh.get("tokens_in", 0) == 0
    if not backend:
        assert check(short_tmp / "var").ok


async def test_a_summariser_ignoring_its_budget_never_has_its_answer_stored(
        short_tmp: Path, stub: Any, backend: dict[str, Any]) -> None:
    huge = "a summary that never ends, " * 80_000  # about 2 MB, whatever max_tokens said

    def unbounded(messages: list[dict[str, Any]]) -> str:
        return huge

    stub.answer = answering(unbounded)
    async with running_daemon(short_tmp, **settings(stub, **backend)) as daemon, connected(daemon) as client:
        for turn in range(1, 31):
            await complete(client, model=SMALL, prompt=FACT if turn == 1 else FILLER, conversation_id="big",
                           create=True)
            await settled(daemon)
        stored = await stored_summaries(daemon, "big")
        stats = await client.request("conversation:stats", {"conversation_id": "big"})
    assert stored and all(s.fallback and len(s.text) < 4000 for s in stored)
    reasons = {r for p in stats["compaction"]["parts"] for c in p["checks"]["candidates"] for r in c.get("reasons", [])}
    assert {"longer_than_input", "over_budget"} <= reasons
    # never fed back: every summariser prompt is small, and so is every turn's
    assert all(len(str(c["messages"])) < 60_000 for c in summariser_calls(stub))
    assert all(len(str(c["messages"])) < 20_000 for c in turn_calls(stub))
    assert all(part in sent_text(turn_calls(stub)[-1]) for part in FACT_PARTS)


def test_doctor_reports_summaries_and_metadata_left_without_an_index(short_tmp: Path) -> None:
    layout = VarLayout(short_tmp / "var")
    layout.summaries_file("ghost").parent.mkdir(parents=True)
    layout.summaries_file("ghost").write_text(json.dumps({"v": 1, "type": "summary", "conversation_id": "ghost",
                                                          "upto": 2, "text": "gone"}) + "\n")
    layout.meta_file("ghost").parent.mkdir(parents=True)
    layout.meta_file("ghost").write_text(json.dumps({"conversation_id": "ghost", "status": "archived",
                                                     "exchanges": 0, "extra": {"compaction": {"summaries": 1}}}))
    layout.meta_file("fresh").write_text(json.dumps({"conversation_id": "fresh", "exchanges": 0}))  # not yet used
    found = {(p.kind, Path(p.path).name) for p in check(layout.root).problems if p.kind.endswith("_without_index")}
    assert found == {("summary_without_index", "ghost.jsonl"), ("metadata_without_index", "ghost.json")}


def test_doctor_leaves_alone_an_import_whose_index_the_next_start_moves_in(short_tmp: Path) -> None:
    """Killed between an import's metadata (its commit point) and the move of its hidden index."""
    layout = VarLayout(short_tmp / "var")
    layout.meta_file("moved-in").parent.mkdir(parents=True)
    layout.meta_file("moved-in").write_text(json.dumps({"conversation_id": "moved-in", "exchanges": 3}))
    layout.pending_import_file("moved-in").parent.mkdir(parents=True)
    layout.pending_import_file("moved-in").write_text('{"v": 1, "n": 1, "response_id": "r1"}\n')
    assert not [p for p in check(layout.root).problems if p.kind == "metadata_without_index"]
    layout.pending_import_file("moved-in").unlink()
    assert [p.extra["conversation_id"] for p in check(layout.root).problems
            if p.kind == "metadata_without_index"] == ["moved-in"]
