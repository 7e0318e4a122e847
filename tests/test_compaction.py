"""Compaction: chunk summaries of exactly the left-out exchanges head the history, written in the
background from the exchanges themselves (never rewritten from an earlier summary), checked before
they are used, replaced by a fallback that keeps the user's words when they fail, merged only past
their share of the budget, shared by forks of their prefix, kept across restarts."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ksi_common.summaries import read_summaries
from ksi_daemon.daemon import Daemon
from ksi_daemon.services.completion.compaction import GAP_EXCHANGES, MERGE_REQUEST, SUMMARISER_SYSTEM
from ksi_daemon.services.conversations.memory import ConversationMemory
from tests.conftest import complete, connected, running_daemon, stub_settings
from tests.stub_openai import Reply

SMALL = "openai/stub-small"
WRITER = "openai/stub-summariser"
WRITER_AT_STUB = "stub-summariser"  # the name the stub is asked for (litellm drops the provider)
SUMMARY_MARK = SUMMARISER_SYSTEM[:40]
FACT = "My name is Alice Bowman, my locker number is 4817 and I decided to take the night train to Lyon."
FACT_PARTS = ("Alice Bowman", "4817", "night train")
FILLER = ("please describe the sea and the sky in spring, with clouds, waves, birds, light, wind, sand, "
          "shells, boats, gulls, rain, fog, tides and the colour of the water at dusk ") * 2


def is_summariser_call(body: dict[str, Any]) -> bool:
    first = body["messages"][0]
    return first["role"] == "system" and str(first["content"]).startswith(SUMMARY_MARK)


def summariser_request(messages: list[dict[str, Any]]) -> str:
    return str(messages[-1]["content"])


# -- summariser stubs: test fakes, each answering summariser calls its own way ------------------
def good(messages: list[dict[str, Any]]) -> str:
    """Keeps every user line that says something (filler dropped), section by section; a merge
    keeps the lines of the summaries it reads."""
    request = summariser_request(messages)
    if MERGE_REQUEST in request:
        lines = [line for line in request.splitlines()
                 if line.startswith("- ") and not line.startswith("- turns")]
        turns = re.findall(r"- turns (.*)", request)
        return "## User and goals\n" + "\n".join(dict.fromkeys(lines)) + f"\n- turns {' '.join(turns)}"
    said = [m for m in re.findall(r"\] User: (.*)", request) if not m.startswith("please describe")]
    shown = re.findall(r"^\[(\d+)\] User", request, re.MULTILINE)
    return ("## User and goals\n" + "".join(f"- {line}\n" for line in said)
            + f"- turns {shown[0]}-{shown[-1]}" if shown else "none")


def apologises(_messages: list[dict[str, Any]]) -> str:
    return "I apologize, but I need more information about the conversation to write a summary."


def asks_back(_messages: list[dict[str, Any]]) -> str:
    return "Which parts of the conversation would you like me to summarise?"


def last_exchange_only(messages: list[dict[str, Any]]) -> str:
    lines = [line for line in summariser_request(messages).splitlines() if re.match(r"\[\d+\] ", line)]
    return "\n".join(lines[-2:]) or "none"


def drops_names(messages: list[dict[str, Any]]) -> str:
    return good(messages).replace("Alice Bowman", "the user").replace("Lyon", "a city")


def says_more(messages: list[dict[str, Any]]) -> str:
    return summariser_request(messages) * 3


def answering(summariser: Callable[[list[dict[str, Any]]], str]) -> Callable[[list[dict[str, Any]]], str]:
    def answer(messages: list[dict[str, Any]]) -> str:
        return summariser(messages) if is_summariser_call({"messages": messages}) else "ok"
    return answer


# -- a conversation whose window holds about five exchanges ------------------------------------
def settings(stub: Any, window: int = 900, **overrides: Any) -> dict[str, Any]:
    models = {SMALL: {"api_base": stub.api_base, "context_window": window, "output_reserve": 100},
              WRITER: {"api_base": stub.api_base}}
    values = {"calibration": False, "summary_retry_delay": 0.05, "summary_retry_max_delay": 0.2,
              "summariser": WRITER, **overrides}
    return stub_settings(stub, models=models, **values)


async def settled(daemon: Daemon) -> None:
    """Wait until no summary is being written (background work, polled)."""
    compactor = daemon.completion.compactor
    for _ in range(1000):
        if not compactor.health()["running"]:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the summariser never finished")


def prompt(turn: int) -> str:
    return FACT if turn == 1 else FILLER


def turn_calls(stub: Any) -> list[dict[str, Any]]:
    return [body for body in stub.requests if not is_summariser_call(body)]


def summariser_calls(stub: Any) -> list[dict[str, Any]]:
    return [body for body in stub.requests if is_summariser_call(body)]


def sent_text(body: dict[str, Any]) -> str:
    return "\n".join(str(m["content"]) for m in body["messages"][:-1])  # all but the new input


async def grow(daemon: Daemon, conversation_id: str, turns: range, model: str = SMALL,
               text: Callable[[int], str] = prompt) -> list[dict[str, Any]]:
    results = []
    async with connected(daemon) as client:
        for turn in turns:
            results.append(await complete(client, model=model, prompt=text(turn), conversation_id=conversation_id,
                                          create=True))
            await settled(daemon)
    return results


def summaries_file(root: Path, conversation_id: str) -> Path:
    return root / "var" / "logs" / "summaries" / f"{conversation_id}.jsonl"


@pytest.mark.parametrize(("summariser", "reasons"), [
    (apologises, {"refusal"}),
    (asks_back, {"question"}),
    (last_exchange_only, {"dropped_items"}),
    (drops_names, {"dropped_items"}),
    (says_more, {"longer_than_input", "over_budget"}),
])
async def test_a_bad_summary_is_never_used_and_the_fact_of_exchange_1_reaches_turn_60(
        short_tmp: Path, stub: Any, summariser: Callable[[list[dict[str, Any]]], str], reasons: set[str]) -> None:
    stub.answer = answering(summariser)
    async with running_daemon(short_tmp, **settings(stub)) as daemon:
        results = await grow(daemon, "bad", range(1, 61))
        async with connected(daemon) as client:
            stats = await client.request("conversation:stats", {"conversation_id": "bad"})
    assert results[-1]["history"]["exchanges_sent"] <= 7  # the window holds a handful of exchanges
    for turn, body in enumerate(turn_calls(stub)[1:], start=2):  # every later turn carries the fact
        assert all(part in sent_text(body) for part in FACT_PARTS), f"turn {turn} lost the fact"
    parts = stats["compaction"]["parts"]
    chunks = [p for p in parts if p["level"] == 0 and p["first"] == 1]
    assert chunks and chunks[0]["fallback"], "the summary of exchange 1 was used although it was bad"
    found = {r for c in chunks[0]["checks"]["candidates"] for r in c.get("reasons", [])}
    assert reasons & found, found
    assert len(chunks[0]["checks"]["candidates"]) == 2  # asked once more, then the fallback
    # nothing a bad summariser wrote was stored
    for record in read_summaries(summaries_file(short_tmp, "bad")):
        assert record.fallback or summariser(  # a filler-only chunk may be summarised fine
            [{"role": "system", "content": ""}, {"role": "user", "content": ""}]) not in record.text


async def test_a_failing_summariser_gives_way_to_the_fallback(short_tmp: Path, stub: Any) -> None:
    stub.answer = answering(good)
    stub.model_script[WRITER_AT_STUB] = deque([Reply(status=500)] * 10_000)
    async with running_daemon(short_tmp, **settings(stub)) as daemon:
        results = await grow(daemon, "failing", range(1, 61))
        async with connected(daemon) as client:
            stats = await client.request("conversation:stats", {"conversation_id": "failing"})
    assert all(r["content"] == "ok" for r in results)
    for body in turn_calls(stub)[1:]:
        assert all(part in sent_text(body) for part in FACT_PARTS)
    parts = stats["compaction"]["parts"]
    assert parts and all(p["fallback"] for p in parts)
    assert any(r.startswith("error:") for p in parts for c in p["checks"]["candidates"] for r in c.get("reasons", []))


async def test_a_good_summariser_is_used_merged_past_its_share_and_bounded(short_tmp: Path, stub: Any) -> None:
    stub.answer = answering(good)
    async with running_daemon(short_tmp, **settings(stub)) as daemon:
        results = await grow(daemon, "good", range(1, 61))
        async with connected(daemon) as client:
            stats = await client.request("conversation:stats", {"conversation_id": "good"})
    parts = stats["compaction"]["parts"]
    assert parts and not any(p["fallback"] for p in parts)
    for body in turn_calls(stub)[1:]:
        assert all(part in sent_text(body) for part in FACT_PARTS)
    # chunks are summarised from the exchanges themselves, each exchange once
    calls = summariser_calls(stub)
    chunk_calls = [c for c in calls if MERGE_REQUEST not in summariser_request(c["messages"])]
    summarised = [int(n) for c in chunk_calls for n in re.findall(r"^\[(\d+)\] User", summariser_request(c["messages"]),
                                                                    re.MULTILINE)]
    assert len(summarised) == len(set(summarised))
    assert all("Summary of exchanges" not in summariser_request(c["messages"]) for c in chunk_calls)
    # merges read summaries (the first one, chunks only), and happen only past the share
    merges = [p for p in parts if p["level"] > 0]
    assert merges and min(p["level"] for p in merges) == 1
    assert max(p["level"] for p in parts) <= 3
    chunks = [p for p in parts if p["level"] == 0]
    assert len(merges) < len(chunks)
    # calls and tokens per turn stay bounded: a chunk once every few turns
    assert len(calls) <= len(results) // 2
    assert all(c["max_tokens"] <= 512 for c in calls)
    assert all(len(str(c["messages"])) < 4 * 1200 for c in calls)  # a prompt within about the window
    assert all(c.get("temperature") == 0 for c in calls)  # sampled deterministically
    stored = read_summaries(summaries_file(short_tmp, "good"))
    assert all(s.first >= 1 and s.upto >= s.first for s in stored)


async def test_no_summariser_runs_while_the_whole_history_fits(short_tmp: Path, stub: Any) -> None:
    stub.answer = answering(good)
    async with running_daemon(short_tmp, **settings(stub, window=4000)) as daemon:
        results = await grow(daemon, "short", range(1, 8))
    assert results[-1]["history"]["exchanges_omitted"] == 0
    assert not summariser_calls(stub)


async def test_the_summariser_runs_once_a_step_not_every_turn(short_tmp: Path, stub: Any) -> None:
    stub.answer = answering(good)
    async with running_daemon(short_tmp, **settings(stub, window=1400, compaction_step=4)) as daemon:
        results = await grow(daemon, "steps", range(1, 41))
    chunks = [r for r in read_summaries(summaries_file(short_tmp, "steps")) if r.level == 0]
    assert len(chunks) >= 3
    assert all(c.upto - c.first + 1 >= 4 for c in chunks[:-1])  # a step ahead
    assert len(summariser_calls(stub)) <= len(results) // 3


async def test_the_history_follows_what_stands_in_for_the_left_out_exchanges(short_tmp: Path, stub: Any) -> None:
    stub.answer = answering(good)
    async with running_daemon(short_tmp, **settings(stub)) as daemon:
        results = await grow(daemon, "long", range(1, 25), text=lambda t: f"turn {t} " + FILLER)
        async with connected(daemon) as client:
            shown = await client.request("conversation:sent", {"conversation_id": "long", "n": 24})
    body = turn_calls(stub)[-1]
    upto = results[-1]["history"]["summary_upto"]
    history = [int(m["content"].split()[1]) for m in body["messages"][1:-1] if m["role"] == "user"]
    assert history == list(range(upto + 1, 24))  # exactly after what stood in
    ranges = [(b["first"], b["upto"]) for b in shown["stand_in"]]
    assert ranges[0][0] == 1 and ranges[-1][1] == upto
    assert all(a[1] + 1 == b[0] for a, b in zip(ranges, ranges[1:], strict=False))  # consecutive
    assert shown["messages"][0]["content"] == body["messages"][0]["content"]  # rebuilt as sent


async def test_a_fork_at_an_early_exchange_has_no_summary_of_later_turns(short_tmp: Path, stub: Any) -> None:
    stub.answer = answering(good)
    async with running_daemon(short_tmp, **settings(stub)) as daemon:
        await grow(daemon, "parent", range(1, 20))
        async with connected(daemon) as client:
            await client.request("conversation:fork", {"conversation_id": "parent", "at": 2, "new_id": "early"})
            fork = await complete(client, model=SMALL, prompt="turn 99", conversation_id="early")
    assert "summary_upto" not in fork["history"]
    sent = stub.requests[-1]["messages"]
    assert "Summary of" not in sent[0]["content"] and [m["content"] for m in sent if m["role"] == "user"] == [
        FACT, FILLER, "turn 99"]


async def test_a_fork_shares_the_summaries_of_its_common_prefix(short_tmp: Path, stub: Any) -> None:
    stub.answer = answering(good)
    async with running_daemon(short_tmp, **settings(stub)) as daemon:
        await grow(daemon, "trunk", range(1, 20))
        covered = max(s.upto for s in read_summaries(summaries_file(short_tmp, "trunk")))
        calls = len(summariser_calls(stub))
        async with connected(daemon) as client:
            await client.request("conversation:fork", {"conversation_id": "trunk", "at": covered + 1,
                                                       "new_id": "branch"})
            fork = await complete(client, model=SMALL, prompt=FILLER, conversation_id="branch")
            await settled(daemon)
            show = await client.request("conversation:show", {"conversation_id": "branch"})
    assert fork["history"].get("summary_upto", 0) >= 1
    assert all(part in sent_text(turn_calls(stub)[-1]) for part in FACT_PARTS)
    assert len(summariser_calls(stub)) <= calls + 2  # reused, not written again from scratch
    assert all(s["upto"] <= covered + 1 or s["conversation_id"] == "branch" for s in show["summaries"])


async def test_compaction_off_keeps_only_the_note(short_tmp: Path, stub: Any) -> None:
    stub.answer = answering(good)
    async with running_daemon(short_tmp, **settings(stub, summariser="off")) as daemon:
        results = await grow(daemon, "plain", range(1, 12))
    assert not summariser_calls(stub)
    assert results[-1]["history"]["exchanges_sent"] < results[-1]["history"]["exchanges_total"]
    assert "earlier exchanges were left out" in stub.requests[-1]["messages"][0]["content"]
    assert not (short_tmp / "var" / "logs" / "summaries").exists()


async def test_a_slow_summariser_never_delays_a_turn_and_the_fallback_stands_in(short_tmp: Path, stub: Any) -> None:
    stub.answer = answering(good)
    gate = stub.model_gate[WRITER_AT_STUB] = asyncio.Event()  # the summariser answers only when told
    async with running_daemon(short_tmp, **settings(stub)) as daemon:
        async with connected(daemon) as client:
            turn = 0
            while not summariser_calls(stub):  # grow until the summariser is called (and hangs)
                turn += 1
                await complete(client, model=SMALL, prompt=prompt(turn), conversation_id="busy", create=True)
                await asyncio.sleep(0.05)
            for extra in range(turn + 1, turn + 12):  # turns go on while it is still writing
                result = await complete(client, model=SMALL, prompt=FILLER, conversation_id="busy")
                assert daemon.completion.compactor.health()["running"] == 1
            assert len(summariser_calls(stub)) == 1
            assert "recent" in result["history"]["summary_kinds"]
            assert all(part in sent_text(turn_calls(stub)[-1]) for part in FACT_PARTS)
            gate.set()
            await settled(daemon)


async def test_summaries_are_read_back_after_a_restart_not_recomputed(short_tmp: Path, stub: Any) -> None:
    stub.answer = answering(good)
    async with running_daemon(short_tmp, **settings(stub)) as daemon:
        await grow(daemon, "kept", range(1, 20))
    records = read_summaries(summaries_file(short_tmp, "kept"))
    calls = len(summariser_calls(stub))
    async with running_daemon(short_tmp, **settings(stub, compaction_step=50)) as daemon, \
            connected(daemon) as client:
        result = await complete(client, model=SMALL, prompt="tiny", conversation_id="kept")
        await settled(daemon)
        stats = await client.request("conversation:stats", {"conversation_id": "kept"})
        exported = await client.request("conversation:export", {"conversation_id": "kept", "format": "markdown"})
    assert result["history"]["summary_upto"] >= 1
    assert "[Summary of exchanges 1-" in stub.requests[-1]["messages"][0]["content"]
    assert stats["compaction"]["summaries"] >= len(records) and stats["compaction"]["exchanges_covered"] >= 1
    # a summary's tokens count in the conversation's usage
    assert stats["compaction"]["tokens_in"] > 0
    assert stats["conversation"]["tokens_in"] == stats["tokens_in"] + stats["compaction"]["tokens_in"]
    assert "**Summary of exchanges 1-" in exported["content"]
    assert len(summariser_calls(stub)) <= calls + 2
    # the CLI reads the same records from disk, daemon stopped
    shown = subprocess.run([sys.executable, "-m", "ksi_cli", "conversation", "show", "kept",
                            "--var-dir", str(short_tmp / "var")], capture_output=True, text=True, timeout=60,
                           stdin=subprocess.DEVNULL)
    assert shown.returncode == 0, shown.stderr
    listed = json.loads(shown.stdout)["summaries"]
    assert listed[-1]["type"] == "summary" and listed[0]["first"] == 1


async def test_a_running_summary_written_before_chunks_still_stands_in(short_tmp: Path, stub: Any) -> None:
    stub.answer = answering(good)
    async with running_daemon(short_tmp, **settings(stub, summariser="off")) as daemon:
        await grow(daemon, "legacy", range(1, 16))
    path = summaries_file(short_tmp, "legacy")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"v": 1, "type": "summary", "conversation_id": "legacy", "upto": 9, "previous_upto": 5,
                                "text": "The user is Alice Bowman (locker 4817), taking the night train to Lyon.",
                                "model": WRITER, "tokens": 30}) + "\n")
    async with running_daemon(short_tmp, **settings(stub, compaction_step=50)) as daemon, \
            connected(daemon) as client:
        result = await complete(client, model=SMALL, prompt="tiny", conversation_id="legacy")
    assert result["history"]["summary_upto"] >= 9
    assert "[Summary of exchanges 1-9 of this conversation" in turn_calls(stub)[-1]["messages"][0]["content"]


def fact_of(turn: int) -> str:
    """A turn with items of its own (a name, a number, a path), so every exchange of a gap adds some."""
    return (f"I decided that the crate numbered {7000 + turn} goes to Marta Quill-{turn} by barge; "
            f"its manifest is at /srv/manifests/crate-{turn}.json. " + FILLER[:200])


async def test_a_turn_between_two_summaries_gets_the_same_stand_in_with_items_remembered_as_read_again(
        short_tmp: Path, stub: Any) -> None:
    stub.answer = answering(good)
    gate = stub.model_gate[WRITER_AT_STUB] = asyncio.Event()  # the summariser hangs: every turn has a gap
    async with running_daemon(short_tmp, **settings(stub)) as daemon:
        compactor = daemon.completion.compactor
        async with connected(daemon) as client:
            turn = 0
            while not summariser_calls(stub):
                turn += 1
                await complete(client, model=SMALL, prompt=fact_of(turn), conversation_id="gap", create=True)
            for turn in range(turn + 1, turn + 8):
                result = await complete(client, model=SMALL, prompt=fact_of(turn), conversation_id="gap")
            assert "recent" in result["history"]["summary_kinds"]
            memory = daemon.completion.cache.cached("gap")
            assert memory is not None
            budget = await compactor.budget_for(SMALL, memory.meta.system, 50, None)
            remembered = await compactor.for_turn(memory, SMALL, budget)
            memory.texts.clear()  # read again from storage: every exchange's items found anew
            fresh = await compactor.for_turn(memory, SMALL, budget)
            assert remembered is not None and fresh is not None
            assert [(b.first, b.upto, b.kind, b.text) for b in remembered.blocks] == \
                [(b.first, b.upto, b.kind, b.text) for b in fresh.blocks]
            assert remembered.tokens == fresh.tokens
            assert "Marta Quill-2" in remembered.blocks[-1].text  # the gap's own items are in it

            # deleted, the id starts afresh: nothing remembered of the old exchanges stands in
            await client.request("conversation:delete", {"conversation_id": "gap"})
            for turn in range(100, 100 + turn):
                result = await complete(client, model=SMALL, prompt=fact_of(turn), conversation_id="gap",
                                        create=True)
            assert "recent" in result["history"]["summary_kinds"]
            sent = sent_text(turn_calls(stub)[-1])
            assert "Marta Quill-100" in sent
            assert "Marta Quill-2 " not in sent and "crate-2.json" not in sent
            gate.set()
            await settled(daemon)


async def test_a_cold_turn_between_two_summaries_reads_its_gap_not_the_whole_index(short_tmp: Path, stub: Any) -> None:
    document = {"format": "ksi.conversation", "v": 1, "conversation": {"system": None}, "exchanges": [
        {"inputs": [{"type": "user", "content": fact_of(n)}], "reply": {"content": f"noted {n}"}}
        for n in range(1, 301)]}
    async with running_daemon(short_tmp, **settings(stub)) as daemon, connected(daemon) as client:
        await client.request("conversation:import", {"data": document, "new_id": "long"})
    async with running_daemon(short_tmp, **settings(stub)) as daemon:  # restarted: nothing in memory
        compactor = daemon.completion.compactor
        memory = await daemon.completion.cache.require("long")
        budget = await compactor.budget_for(SMALL, None, 50, None)
        await daemon.completion.cache.widen(memory, budget)  # as a turn's preparation loads it
        stand_in = await compactor.for_turn(memory, SMALL, budget)
        assert memory.first_loaded > 100  # a tail of the index, not all of it
        assert stand_in is not None and stand_in.blocks[-1].kind == "recent"
        left_out = stand_in.blocks[-1].upto
        first = left_out - GAP_EXCHANGES + 1  # the oldest exchange of the gap a turn reads: its items lead
        assert f"Marta Quill-{first} " in stand_in.blocks[-1].text
        entries = await daemon.completion.cache.store.entries("long")
        whole_index = ConversationMemory(memory.meta)  # the whole index loaded, as before: the same stand-in
        whole_index.set_entries(entries, entries[-1].n)
        whole = await compactor.for_turn(whole_index, SMALL, budget)
        assert whole is not None and [b.text for b in whole.blocks] == [b.text for b in stand_in.blocks]
