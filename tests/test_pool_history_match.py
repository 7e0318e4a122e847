"""On the pool (two daemons on one PostgreSQL database), a client-held history whose conversation
has a turn in flight on the other daemon is continued in a fork, as on one daemon: the check
for a turn in flight asks the pool's line, not only this daemon's requests."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from ksi_daemon.daemon import Daemon
from tests.conftest import complete, connected, running_daemon, stub_settings
from tests.stored import stored_index
from tests.stub_openai import Reply, StubOpenAI


async def test_one_history_sent_to_two_daemons_at_once_is_stored_once_in_place(
        short_tmp: Path, stub: StubOpenAI, pg_url: str) -> None:
    settings: dict[str, Any] = {**stub_settings(stub), "storage": "postgres", "database_url": pg_url}
    (short_tmp / "a").mkdir()
    (short_tmp / "b").mkdir()
    async with running_daemon(short_tmp / "a", **settings) as a, running_daemon(short_tmp / "b", **settings) as b, \
            connected(a) as on_a, connected(b) as on_b:
        first = await complete(on_a, prompt="p1", conversation_id="c1", create=True)
        history = [{"role": "user", "content": "p1"}, {"role": "assistant", "content": first["content"]}]
        gate = asyncio.Event()
        stub.enqueue(Reply(text="the first answer", gate=gate))
        running = await on_a.request("completion:async", {"prompt": "p2", "history": history, "stream": True})
        assert running["conversation_id"] == "c1"  # in place: nothing else runs there yet
        await until_streaming(stub)
        other = await on_b.request("completion:async", {"prompt": "p2", "history": history})
        gate.set()
        done = await on_a.request("completion:wait", {"request_id": running["request_id"], "timeout": 30})
        forked = await on_b.request("completion:wait", {"request_id": other["request_id"], "timeout": 30})
        assert done["conversation_id"] == "c1" and done["exchange"] == 2
        assert forked["conversation_id"] != "c1" and forked["exchange"] == 2  # a fork at exchange 1
        assert len(await stored_index(a, "c1")) == 2  # not appended twice in place


async def until_streaming(stub: StubOpenAI) -> None:
    """Until the first turn's call reached the stub (a safety net of a minute, not a timing check)."""
    async with asyncio.timeout(60):
        while len(stub.requests) < 2:
            await asyncio.sleep(0.02)


async def test_one_history_sent_to_two_daemons_at_the_same_moment_is_continued_in_place_once(
        short_tmp: Path, stub: StubOpenAI, pg_url: str) -> None:
    settings: dict[str, Any] = {**stub_settings(stub), "storage": "postgres", "database_url": pg_url}
    (short_tmp / "a").mkdir()
    (short_tmp / "b").mkdir()
    async with running_daemon(short_tmp / "a", **settings) as a, running_daemon(short_tmp / "b", **settings) as b, \
            connected(a) as on_a, connected(b) as on_b:
        reply = (await complete(on_a, prompt="p0", conversation_id="c1", create=True))["content"]
        history = [{"role": "user", "content": "p0"}, {"role": "assistant", "content": reply}]
        for round_ in range(1, 6):
            acks = await asyncio.gather(*(client.request("completion:async", {"prompt": f"p{round_}",
                                                                              "history": history})
                                          for client in (on_a, on_b)))
            results = [await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 30})
                       for client, ack in zip((on_a, on_b), acks, strict=True)]
            # one continues the conversation the history matched in place, the other a fork of it
            assert results[0]["conversation_id"] != results[1]["conversation_id"], round_
            assert [r["exchange"] for r in results] == [round_ + 1, round_ + 1], round_
            history = [*history, {"role": "user", "content": f"p{round_}"},
                       {"role": "assistant", "content": results[0]["content"]}]
        assert len(await stored_index(a, "c1")) <= 6  # never two exchanges in place in one round



async def test_pending_input_added_through_one_daemon_is_taken_by_a_history_sent_to_another(
        short_tmp: Path, stub: StubOpenAI, pg_url: str) -> None:
    """The history names the conversation by its digests: the daemon it reaches reads the pending
    input as stored, even with the conversation in its memory from an earlier turn."""
    settings: dict[str, Any] = {**stub_settings(stub), "storage": "postgres", "database_url": pg_url}
    (short_tmp / "a").mkdir()
    (short_tmp / "b").mkdir()
    async with running_daemon(short_tmp / "a", **settings) as a, running_daemon(short_tmp / "b", **settings) as b, \
            connected(a) as on_a, connected(b) as on_b:
        first = await complete(on_b, prompt="q1", conversation_id="c1", create=True)
        await on_a.request("conversation:pend", {"conversation_id": "c1", "inputs": ["q2"]})
        second = await complete(on_b, history=[{"role": "user", "content": "q1"},
                                               {"role": "assistant", "content": first["content"]}],
                                input=[{"type": "message", "role": "user", "content": "q2"}])
        assert second["conversation_id"] == "c1" and second["exchange"] == 2
        assert [m["content"] for m in stub.messages() if m["role"] == "user"] == ["q1", "q2"]  # q2 once
        shown = await on_a.request("conversation:show", {"conversation_id": "c1"})
        assert shown["conversation"]["pending_input"] == []


async def until_heard(daemon: Daemon) -> None:
    """Until the other daemon's word that a conversation waits reached `daemon` (its relay is a live
    feed of milliseconds; a safety net of a minute, not a timing check)."""
    async with asyncio.timeout(60):
        while not len(daemon.cache.waiting):
            await asyncio.sleep(0.02)


async def test_pending_input_added_through_one_daemon_is_taken_by_a_request_on_another(
        short_tmp: Path, stub: StubOpenAI, pg_url: str) -> None:
    """The Agents SDK's first turn: a conversation made with the user's item on one daemon, the
    response asked of another with that item and no conversation."""
    settings: dict[str, Any] = {**stub_settings(stub), "storage": "postgres", "database_url": pg_url}
    (short_tmp / "a").mkdir()
    (short_tmp / "b").mkdir()
    async with running_daemon(short_tmp / "a", **settings) as a, running_daemon(short_tmp / "b", **settings) as b, \
            connected(a) as on_a, connected(b) as on_b:
        document = {"format": "ksi.conversation", "v": 1, "conversation": {"system": None}, "exchanges": []}
        made = await on_a.request("conversation:import", {"data": document, "format": "json", "pending": ["q1"]})
        await until_heard(b)
        first = await complete(on_b, input=[{"type": "message", "role": "user", "content": "q1"}],
                               instructions="Reply very concisely.")
        assert first["conversation_id"] == made["conversation_id"]
        shown = await on_a.request("conversation:show", {"conversation_id": made["conversation_id"]})
        assert shown["conversation"]["pending_input"] == [] and len(shown["exchanges"]) == 1
        listing = await on_a.request("conversation:list", {})
        assert [c["conversation_id"] for c in listing["conversations"]] == [made["conversation_id"]]
