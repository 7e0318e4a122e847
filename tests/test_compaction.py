"""Compaction: a summary of exactly the left-out exchanges heads the history, written in the
background, extended incrementally, shared by forks of its prefix, kept across restarts."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections import deque
from pathlib import Path
from typing import Any

from ksi_common.summaries import read_summaries
from ksi_daemon.daemon import Daemon
from ksi_daemon.services.completion.compaction import SUMMARISER_SYSTEM
from tests.conftest import complete, connected, running_daemon, stub_settings
from tests.stub_openai import Reply

SMALL = "openai/stub-small"
WRITER = "openai/stub-summariser"
WRITER_AT_STUB = "stub-summariser"  # the name the stub is asked for (litellm drops the provider)
SUMMARY_MARK = SUMMARISER_SYSTEM.split(" ", 4)[:4]


def is_summariser_call(body: dict[str, Any]) -> bool:
    first = body["messages"][0]
    return first["role"] == "system" and str(first["content"]).startswith(" ".join(SUMMARY_MARK))


def answer(messages: list[dict[str, Any]]) -> str:
    """Turns get a short answer; the summariser lists the turn numbers it was shown."""
    if is_summariser_call({"messages": messages}):
        shown = re.findall(r"\] User: turn (\d+)", messages[-1]["content"])
        earlier = re.search(r"Summary of exchanges 1-(\d+)", messages[-1]["content"])
        return f"summary: earlier upto {earlier.group(1) if earlier else 0}; turns {' '.join(shown)}"
    return "ok"


def settings(stub: Any, window: int = 700, **overrides: Any) -> dict[str, Any]:
    models = {SMALL: {"api_base": stub.api_base, "context_window": window, "output_reserve": 100},
              WRITER: {"api_base": stub.api_base}}
    values = {"calibration": False, "summary_max_tokens": 120, "compaction_step": 1,
              "summary_retry_delay": 0.05, **overrides}
    return stub_settings(stub, models=models, **values)


async def settled(daemon: Daemon) -> None:
    """Wait until no summary is being written (background work, polled)."""
    compactor = daemon.completion.compactor
    for _ in range(500):
        if not compactor.health()["running"]:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the summariser never finished")


def prompt(turn: int) -> str:
    return f"turn {turn} " + " ".join(f"fact{turn}x{i}" for i in range(30))


def turns_in(messages: list[dict[str, Any]]) -> list[int]:
    return [int(m["content"].split()[1]) for m in messages if m["role"] == "user"]


def summariser_calls(stub: Any) -> list[dict[str, Any]]:
    return [body for body in stub.requests if is_summariser_call(body)]


async def grow(daemon: Daemon, conversation_id: str, turns: range, model: str = SMALL) -> list[dict[str, Any]]:
    results = []
    async with connected(daemon) as client:
        for turn in turns:
            results.append(await complete(client, model=model, prompt=prompt(turn), conversation_id=conversation_id,
                                          create=True))
            await settled(daemon)
    return results


async def test_the_history_starts_with_a_summary_of_exactly_the_left_out_exchanges(short_tmp: Path, stub: Any) -> None:
    stub.answer = answer
    async with running_daemon(short_tmp, **settings(stub)) as daemon:
        results = await grow(daemon, "long", range(1, 13))
    turns = [body for body in stub.requests if not is_summariser_call(body)]
    summarised = [(result, body) for result, body in zip(results, turns, strict=True)
                  if "summary_upto" in result["history"]]
    assert summarised, "the conversation outgrew its window but no summary was used"
    for result, body in summarised:
        upto = result["history"]["summary_upto"]
        system = body["messages"][0]["content"]
        assert f"[Summary of exchanges 1-{upto} of this conversation" in system
        history = turns_in(body["messages"])[:-1]  # the last user message is the new input
        assert history == list(range(upto + 1, upto + 1 + len(history)))  # exactly after the summary
        assert "left out" not in system.split("]\n", 1)[1]  # no exchange left out beyond the summary
    calls = summariser_calls(stub)
    records = read_summaries(short_tmp / "var" / "logs" / "summaries" / "long.jsonl")
    assert len(calls) == len(records) >= 2
    previous = 0
    for call, record in zip(calls, records, strict=True):
        text = call["messages"][-1]["content"]
        assert record.previous_upto == previous
        # incremental: the old summary plus only the newly left-out exchanges, never the whole history
        assert [int(t) for t in re.findall(r"\] User: turn (\d+)", text)] == list(range(previous + 1, record.upto + 1))
        assert (f"Summary of exchanges 1-{previous}:" in text) == (previous > 0)
        previous = record.upto


async def test_a_summary_is_extended_only_when_more_exchanges_fall_out(short_tmp: Path, stub: Any) -> None:
    stub.answer = answer
    async with running_daemon(short_tmp, **settings(stub, window=1600, compaction_step=3)) as daemon:
        results = await grow(daemon, "steps", range(1, 25))
    records = read_summaries(short_tmp / "var" / "logs" / "summaries" / "steps.jsonl")
    uptos = [r.upto for r in records]
    assert uptos == sorted(set(uptos)) and len(uptos) >= 2
    assert len(summariser_calls(stub)) == len(records) < len(results) // 2  # not once per turn


async def test_a_fork_at_an_early_exchange_has_no_summary_of_later_turns(short_tmp: Path, stub: Any) -> None:
    stub.answer = answer
    async with running_daemon(short_tmp, **settings(stub)) as daemon:
        await grow(daemon, "parent", range(1, 13))
        async with connected(daemon) as client:
            await client.request("conversation:fork", {"conversation_id": "parent", "at": 2, "new_id": "early"})
            fork = await complete(client, model=SMALL, prompt=prompt(99), conversation_id="early")
    assert "summary_upto" not in fork["history"]
    sent = stub.requests[-1]["messages"]
    assert "Summary of" not in sent[0]["content"] and turns_in(sent) == [1, 2, 99]


async def test_a_fork_shares_the_summary_of_its_common_prefix(short_tmp: Path, stub: Any) -> None:
    stub.answer = answer
    async with running_daemon(short_tmp, **settings(stub)) as daemon:
        await grow(daemon, "trunk", range(1, 13))
        covered = read_summaries(short_tmp / "var" / "logs" / "summaries" / "trunk.jsonl")[-1].upto
        calls = len(summariser_calls(stub))
        async with connected(daemon) as client:
            at = covered + 1
            await client.request("conversation:fork", {"conversation_id": "trunk", "at": at, "new_id": "branch"})
            fork = await complete(client, model=SMALL, prompt=prompt(99), conversation_id="branch")
            await settled(daemon)
            show = await client.request("conversation:show", {"conversation_id": "branch"})
    assert fork["history"].get("summary_upto", 0) >= 1  # the parent's summary of 1..k, k <= at, is used
    assert fork["history"]["summary_upto"] <= at
    assert len(summariser_calls(stub)) in (calls, calls + 1)  # reused, not rewritten from scratch
    assert all(s["upto"] <= at or s["conversation_id"] == "branch" for s in show["summaries"])


async def test_compaction_off_keeps_only_the_note(short_tmp: Path, stub: Any) -> None:
    stub.answer = answer
    async with running_daemon(short_tmp, **settings(stub, summariser="off")) as daemon:
        results = await grow(daemon, "plain", range(1, 12))
    assert not summariser_calls(stub)
    assert results[-1]["history"]["exchanges_sent"] < results[-1]["history"]["exchanges_total"]
    assert "earlier exchanges were left out" in stub.requests[-1]["messages"][0]["content"]
    assert not (short_tmp / "var" / "logs" / "summaries").exists()


async def test_a_slow_summariser_never_delays_a_turn(short_tmp: Path, stub: Any) -> None:
    stub.answer = answer
    gate = stub.model_gate[WRITER_AT_STUB] = asyncio.Event()  # the summariser answers only when told
    async with running_daemon(short_tmp, **settings(stub, summariser=WRITER)) as daemon:
        async with connected(daemon) as client:
            turn = 0
            while not summariser_calls(stub):  # grow until the summariser is called (and hangs)
                turn += 1
                await complete(client, model=SMALL, prompt=prompt(turn), conversation_id="busy", create=True)
                await asyncio.sleep(0.05)
            for extra in range(turn + 1, turn + 4):  # turns go on while it is still writing
                await complete(client, model=SMALL, prompt=prompt(extra), conversation_id="busy")
                assert daemon.completion.compactor.health()["running"] == 1
            assert len(summariser_calls(stub)) == 1
            gate.set()
            await settled(daemon)


async def test_a_failing_summariser_leaves_turns_working_and_is_retried(short_tmp: Path, stub: Any) -> None:
    stub.answer = answer
    stub.model_script[WRITER_AT_STUB] = deque([Reply(status=500), Reply(status=500)])
    async with running_daemon(short_tmp, **settings(stub, summariser=WRITER)) as daemon:
        results = await grow(daemon, "flaky", range(1, 13))
        for _ in range(300):  # the back-off retries until one succeeds
            if read_summaries(short_tmp / "var" / "logs" / "summaries" / "flaky.jsonl"):
                break
            await asyncio.sleep(0.02)
    assert len(results) == 12 and all(r["content"] == "ok" for r in results)
    assert len(summariser_calls(stub)) >= 3  # two refusals, then written
    assert read_summaries(short_tmp / "var" / "logs" / "summaries" / "flaky.jsonl")


async def test_summaries_are_read_back_after_a_restart_not_recomputed(short_tmp: Path, stub: Any) -> None:
    stub.answer = answer
    async with running_daemon(short_tmp, **settings(stub)) as daemon:
        await grow(daemon, "kept", range(1, 13))
    records = read_summaries(short_tmp / "var" / "logs" / "summaries" / "kept.jsonl")
    calls = len(summariser_calls(stub))
    async with running_daemon(short_tmp, **settings(stub, compaction_step=50)) as daemon, \
            connected(daemon) as client:
        result = await complete(client, model=SMALL, prompt="turn 13 tiny", conversation_id="kept")
        await settled(daemon)
        stats = await client.request("conversation:stats", {"conversation_id": "kept"})
        exported = await client.request("conversation:export", {"conversation_id": "kept", "format": "markdown"})
    assert result["history"]["summary_upto"] >= records[-1].upto - 1
    assert f"[Summary of exchanges 1-{result['history']['summary_upto']}" in stub.requests[-1]["messages"][0]["content"]
    assert stats["compaction"]["summaries"] >= len(records) and stats["compaction"]["exchanges_covered"] >= 1
    # a summary's tokens count in the conversation's usage
    assert stats["compaction"]["tokens_in"] > 0
    assert stats["conversation"]["tokens_in"] == stats["tokens_in"] + stats["compaction"]["tokens_in"]
    assert "**Summary of exchanges 1-" in exported["content"]
    assert len(summariser_calls(stub)) <= calls + 1
    # the CLI reads the same records from disk, daemon stopped
    shown = subprocess.run([sys.executable, "-m", "ksi_cli", "conversation", "show", "kept",
                            "--var-dir", str(short_tmp / "var")], capture_output=True, text=True, timeout=60,
                           stdin=subprocess.DEVNULL)
    assert shown.returncode == 0, shown.stderr
    listed = json.loads(shown.stdout)["summaries"]
    assert listed[-1]["type"] == "summary" and listed[-1]["upto"] >= records[-1].upto
