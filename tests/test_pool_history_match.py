"""On the pool (two daemons on one PostgreSQL database), a client-held history whose conversation
has a turn in flight on the other daemon is continued in a fork, as on one daemon: the check
for a turn in flight asks the pool's line, not only this daemon's requests."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

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
