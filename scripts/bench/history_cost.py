"""What preparing turn N+1 of a conversation costs, for N = 10 .. 10,000 exchanges.

    .venv/bin/python scripts/bench/history_cost.py [--sizes 10,100,1000,10000] [--window 8192]

Conversations are built directly on disk in the real formats through the daemon's own JSONL
conversation store (its `append_exchange` writes each response file and index line, as a
completion does), then turn N+1 is prepared in this process with the
real ConversationCache + select_history + build_messages from ksi_daemon/services, the way
CompletionService._prepare does it (budget = window - output reserve - system - new input -
note reserve; no provider call):

  warm       the conversation is already in memory (the daemon's steady state): time to
             prepare the next turn's messages, median of many;
  cold       a fresh cache, as after a restart; the files are in the OS page cache;
  cold disk  the same after evicting this conversation's files from the page cache
             (os.sync + posix_fadvise DONTNEED), so they come from the disk;
  compacted  warm and cold again with compaction on: a summary record stands in for the
             exchanges that no longer fit (written here directly, as the background summariser
             would), so the turn reads the summary and the history after it;
  naive      the baseline of the seed notes (shared/seeds/001_*): every turn reads the
             whole index and every response file it lists, and sends all of it.

Bytes read are the process's own read() bytes (/proc/self/io rchar, worker threads included);
files opened are counted by wrapping open(). Token counts use the daemon's fallback estimate
(ceil(chars / 4)) so litellm is not imported; the budget logic is the same either way.
Goals (DESIGN.md section 7): warm flat in N; cold bounded by the token budget, not by N.

`--tools` builds tool-using conversations instead (issue 29: preparing turn N+1 of one stays flat
in N): in cycles of three exchanges, a user message answered by a tool call, that call's output
answered by another call, its output answered by text; the last exchange is a user message
answered by a call, and turn N+1's input is that call's output (a `role: tool` message).
Prints a table and writes scripts/bench/results/history_cost.json (history_cost_tools.json).
"""

from __future__ import annotations

import argparse
import asyncio
import builtins
import gc
import io
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import RESULTS_DIR, machine, write_results

from ksi_common.ids import new_response_id
from ksi_common.items import output_fields
from ksi_common.layout import VarLayout
from ksi_common.records import IndexEntry, read_index, read_response
from ksi_common.settings import Settings
from ksi_common.summaries import Summary
from ksi_common.timefmt import utc_now
from ksi_daemon.router import Router
from ksi_daemon.services.completion.compaction import Compactor
from ksi_daemon.services.conversations.history import (
    MESSAGE_OVERHEAD,
    NOTE_RESERVE,
    build_messages,
    select_history,
)
from ksi_daemon.services.conversations.memory import ConversationCache, estimate_tokens, exchange_from_response
from ksi_daemon.services.conversations.writer import ConversationWriter
from ksi_daemon.storage.jsonl.conversations import JsonlConversations
from ksi_daemon.storage.jsonl.responses import JsonlResponses
from ksi_daemon.storage.jsonl.summaries import JsonlSummaries
from ksi_daemon.storage.models import ConversationMeta

MODEL = "openai/gpt-4o-mini"
SYSTEM = "You are a careful assistant. Answer briefly and remember what the user told you."
NEW_INPUT = "Given everything we discussed so far, what should I do next, and why?"
WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which "
         "but have an they you were her she there one all we can their has been if more when will "
         "would who so no model token budget context window history memory daemon conversation "
         "request response index file disk cache restart continuity provider answer question").split()


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


# -- building conversations on disk -----------------------------------------------------------
def call_id(n: int) -> str:
    return f"call_{n:08x}"


def tool_lines(n: int, user: str, reply: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Exchange n of a tool-using conversation: its input line and the outcome's fields (see --tools)."""
    if n % 3 == 1:
        first: dict[str, Any] = {"type": "user", "content": user}
    else:
        first = {"type": "function_call_output", "call_id": call_id(n - 1), "output": reply[:200]}
    if n % 3 == 0:
        output = [{"type": "message", "role": "assistant", "content": reply}]
    else:
        output = [{"type": "function_call", "call_id": call_id(n), "name": f"tool_{n % 10}",
                   "arguments": f'{{"city": "City {n}", "count": 2}}'}]
    return first, output_fields(output)


def message_tokens(message: dict[str, Any]) -> int:
    """A chat message's estimated tokens: its text and its tool calls' arguments."""
    text = str(message.get("content") or "")
    text += "".join(c["function"]["arguments"] for c in message.get("tool_calls") or ())
    return estimate_tokens(text) + MESSAGE_OVERHEAD


async def build(layout: VarLayout, conversation_id: str, exchanges: int, seed: int,
                tools: bool = False) -> dict[str, Any]:
    """`exchanges` exchanges written the way the daemon writes them (fsync off, for speed)."""
    rng = random.Random(seed)
    store = JsonlConversations(layout, fsync=False)
    for directory in (layout.responses_dir, layout.conversations_dir, layout.conversation_meta_dir):
        directory.mkdir(parents=True, exist_ok=True)
    await store.create(ConversationMeta(conversation_id=conversation_id, system=SYSTEM))
    tokens = 0
    started = time.perf_counter()
    for n in range(1, exchanges + 1):
        response_id = new_response_id(MODEL)
        request_id = f"req-{n:012x}"
        ts = utc_now()
        user = sentence(rng, rng.randint(20, 80))
        reply = " ".join(sentence(rng, rng.randint(10, 30)) for _ in range(rng.randint(3, 8)))
        first: dict[str, Any] = {"type": "user", "content": user}
        outcome: dict[str, Any] = {"content": reply}
        if tools:
            first, outcome = tool_lines(n, user, reply)
        tokens_in = estimate_tokens(str(first.get("content") or first.get("output"))) + MESSAGE_OVERHEAD
        tokens_out = estimate_tokens(str(outcome["content"] or outcome.get("output"))) + MESSAGE_OVERHEAD
        response = [
            {"v": 1, **first, "ts": ts, "request_id": request_id, "conversation_id": conversation_id},
            {"v": 1, "type": "assistant", **outcome, "model": MODEL, "provider": "openai",
             "usage": {"prompt_tokens": tokens_in, "completion_tokens": tokens_out,
                       "total_tokens": tokens_in + tokens_out},
             "cost": None, "finish_reason": "stop", "duration_ms": 812.5,
             "provider_response_id": f"chatcmpl-{n:010x}", "attempts": [], "ts": ts,
             "request_id": request_id, "conversation_id": conversation_id},
        ]
        await store.append_exchange(conversation_id, IndexEntry(
            n=n, response_id=response_id, ts=ts, model=MODEL, provider="openai",
            tokens_in=tokens_in, tokens_out=tokens_out), response=response)
        tokens += tokens_in + tokens_out
    await store.save_meta(ConversationMeta(conversation_id=conversation_id, system=SYSTEM, exchanges=exchanges,
                                     models=[MODEL]))
    index = layout.index_file(conversation_id)
    return {"exchanges": exchanges, "history_tokens": tokens, "index_bytes": index.stat().st_size,
            "build_s": time.perf_counter() - started}


# -- measuring --------------------------------------------------------------------------------
class ReadCounter:
    """Bytes read by this process (all threads) and files opened, between start() and stop()."""

    def __init__(self) -> None:
        self.opened = 0
        self._open = builtins.open
        base = self._read_proc()
        self._calibration = self._read_proc()[0] - base[0]  # reading /proc itself costs a little

    @staticmethod
    def _read_proc() -> tuple[int, int]:
        with open("/proc/self/io", "rb") as handle:
            fields = dict(line.split(b": ") for line in handle.read().splitlines())
        return int(fields[b"rchar"]), int(fields[b"syscr"])

    def __enter__(self) -> ReadCounter:
        original = self._open

        def counting_open(file: Any, *args: Any, **kwargs: Any) -> Any:
            self.opened += 1
            return original(file, *args, **kwargs)

        builtins.open = counting_open  # type: ignore[assignment]
        io.open = counting_open  # type: ignore[assignment]  # pathlib's read_bytes goes through io.open
        self.opened = 0
        self._start = self._read_proc()
        return self

    def __exit__(self, *exc: object) -> None:
        end = self._read_proc()
        builtins.open = self._open
        io.open = self._open
        self.bytes = end[0] - self._start[0] - self._calibration
        self.reads = end[1] - self._start[1] - 1


def evict(paths: list[Path]) -> None:
    """Drop these files from the OS page cache, so the next read comes from the disk."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def conversation_files(layout: VarLayout, conversation_id: str) -> list[Path]:
    index = layout.index_file(conversation_id)
    return [index, layout.meta_file(conversation_id),
            *(layout.response_file(e.response_id) for e in read_index(index))]


class Preparer:
    """The history part of CompletionService._prepare, on a cache of its own."""

    def __init__(self, layout: VarLayout, window: int, reserve: int, max_depth: int = 32,
                 compaction: bool = False) -> None:
        store = JsonlConversations(layout, fsync=False)
        self.cache = ConversationCache(store, JsonlResponses(layout, fsync=False), capacity=1000)
        self.window = window
        self.reserve = reserve
        self.max_depth = max_depth
        settings = Settings(_env_file=None, var_dir=layout.root, summariser=None if compaction else "off")
        # only the reading side of the compactor runs here: no provider, no answerers, no budget callback
        writer = ConversationWriter(self.cache, JsonlSummaries(layout, fsync=False), clock=time.time,
                                    default_ttl=None, max_fork_depth=max_depth)
        self.compactor = Compactor(settings, Router(), self.cache, writer, provider=None,  # type: ignore[arg-type]
                                   count_tokens=estimate_tokens, budget_for=None,  # type: ignore[arg-type]
                                   answerer_for=None)  # type: ignore[arg-type]

    async def prepare(self, conversation_id: str, user_messages: list[dict[str, Any]]
                      ) -> tuple[list[dict[str, Any]], dict[str, int]]:
        memory = await self.cache.require(conversation_id)
        system = memory.meta.system
        input_tokens = sum(message_tokens(m) for m in user_messages)
        system_tokens = estimate_tokens(system) + MESSAGE_OVERHEAD if system else 0
        budget = self.window - self.reserve - system_tokens - input_tokens - NOTE_RESERVE
        memory = await self.cache.require(conversation_id, budget)
        history = await select_history(self.cache, memory, budget, self.max_depth)
        stand_in = await self.compactor.for_turn(memory, MODEL, budget) if history.omitted else None
        if stand_in is not None and stand_in.tokens < budget:
            budget -= stand_in.tokens
            history = await select_history(self.cache, memory, budget, self.max_depth, stand_in.upto)
        else:
            stand_in = None
        block = stand_in.text() if stand_in is not None else None
        stats = {**history.stats(), "summary_upto": stand_in.upto if stand_in is not None else 0}
        return build_messages(system, history, user_messages, block), stats


async def timed_blocks(preparer: Preparer, conversation_id: str, turn_input: list[dict[str, Any]],
                       runs: int) -> list[list[float]]:
    """Microseconds of `runs` preparations of the next turn, in 10 blocks (the lowest block median is
    robust against bursts of other work on the machine)."""
    blocks = []
    for _ in range(10):
        times = []
        for _ in range(max(1, runs // 10)):
            started = time.perf_counter_ns()
            await preparer.prepare(conversation_id, turn_input)
            times.append((time.perf_counter_ns() - started) / 1000)
        blocks.append(times)
    return blocks


def naive_prepare(layout: VarLayout, conversation_id: str, new_input: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The seed notes' loader: the whole index, then every response file it lists, every turn."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for entry in read_index(layout.index_file(conversation_id)):
        record = read_response(layout.response_file(entry.response_id))
        if record is None:
            continue
        exchange = exchange_from_response(record)
        messages.extend(exchange.chat_messages())
    messages.extend(new_input)
    return messages


def new_input(size: int, tools: bool) -> list[dict[str, Any]]:
    """Turn N+1's input: a user message, or with --tools the output of the call exchange N made."""
    if tools:
        return [{"role": "tool", "tool_call_id": call_id(size), "content": '{"facts": ["it rains", "it is cold"]}'}]
    return [{"role": "user", "content": NEW_INPUT}]


async def measure(layout: VarLayout, conversation_id: str, args: argparse.Namespace, size: int) -> dict[str, Any]:
    result: dict[str, Any] = {}
    turn_input = new_input(size, args.tools)
    files = conversation_files(layout, conversation_id)

    # cold: a fresh cache per run, files in the page cache (first run discarded: it warms the OS)
    cold: list[dict[str, Any]] = []
    for attempt in range(args.cold_runs + 1):
        preparer = Preparer(layout, args.window, args.reserve)
        with ReadCounter() as counter:
            started = time.perf_counter()
            messages, stats = await preparer.prepare(conversation_id, turn_input)
            elapsed = time.perf_counter() - started
        if attempt:
            cold.append({"ms": elapsed * 1000, "bytes": counter.bytes, "files": counter.opened,
                         "reads": counter.reads})
    result["cold"] = {"ms": statistics.median(c["ms"] for c in cold), "bytes": cold[-1]["bytes"],
                      "files": cold[-1]["files"], "reads": cold[-1]["reads"], "runs": cold}
    result["sent"] = {**stats, "messages": len(messages),
                      "tokens_est": sum(message_tokens(m) for m in messages)}

    # cold from the disk: the same, after evicting this conversation's files from the page cache
    disk: list[dict[str, Any]] = []
    for _ in range(args.disk_runs):
        evict(files)
        preparer = Preparer(layout, args.window, args.reserve)
        with ReadCounter() as counter:
            started = time.perf_counter()
            await preparer.prepare(conversation_id, turn_input)
            elapsed = time.perf_counter() - started
        disk.append({"ms": elapsed * 1000, "bytes": counter.bytes, "files": counter.opened})
    result["cold_disk"] = {"ms": statistics.median(d["ms"] for d in disk), "runs": disk}

    # warm: the conversation in memory; prepare the next turn again and again
    # (in blocks: the lowest block median is robust against bursts of other work on the machine)
    preparer = Preparer(layout, args.window, args.reserve)
    await preparer.prepare(conversation_id, turn_input)
    gc.collect()
    with ReadCounter() as counter:
        blocks = await timed_blocks(preparer, conversation_id, turn_input, args.warm_runs)
    every = sorted(t for block in blocks for t in block)
    result["warm"] = {"us": min(statistics.median(block) for block in blocks),
                      "median_us": statistics.median(every), "p90_us": every[int(0.9 * (len(every) - 1))],
                      "bytes_per_turn": counter.bytes / len(every), "files": counter.opened}

    # compaction on: a summary covers exactly what the turn leaves out; warm and cold again
    first_kept = result["sent"]["exchanges_total"] - result["sent"]["exchanges_sent"]
    if first_kept > 0:
        text = sentence(random.Random(size), 300)
        await JsonlSummaries(layout, fsync=False).append(Summary(
            conversation_id=conversation_id, upto=first_kept, text=text, model=MODEL,
            tokens=estimate_tokens(text) + MESSAGE_OVERHEAD, ts=utc_now()))
    compacted_cold = []
    for attempt in range(args.cold_runs + 1):
        preparer = Preparer(layout, args.window, args.reserve, compaction=True)
        with ReadCounter() as counter:
            started = time.perf_counter()
            _messages, compacted_stats = await preparer.prepare(conversation_id, turn_input)
            elapsed = time.perf_counter() - started
        if attempt:
            compacted_cold.append({"ms": elapsed * 1000, "bytes": counter.bytes})
    await preparer.prepare(conversation_id, turn_input)
    compacted_blocks = await timed_blocks(preparer, conversation_id, turn_input, args.warm_runs)
    result["compacted"] = {"warm_us": min(statistics.median(block) for block in compacted_blocks),
                           "cold_ms": statistics.median(c["ms"] for c in compacted_cold),
                           "cold_bytes": compacted_cold[-1]["bytes"], "sent": compacted_stats}

    # the naive baseline: everything re-read every turn (page cache warm after the first)
    runs = max(2, min(args.naive_runs, 20_000 // max(size, 1)))
    naive = []
    for attempt in range(runs + 1):
        with ReadCounter() as counter:
            started = time.perf_counter()
            messages = naive_prepare(layout, conversation_id, turn_input)
            elapsed = time.perf_counter() - started
        if attempt:
            naive.append({"ms": elapsed * 1000, "bytes": counter.bytes, "files": counter.opened})
    result["naive"] = {"ms": statistics.median(n["ms"] for n in naive), "bytes": naive[-1]["bytes"],
                       "files": naive[-1]["files"], "messages": len(messages),
                       "tokens_est": sum(message_tokens(m) for m in messages),
                       "runs": naive}
    return result


# -- report -----------------------------------------------------------------------------------
def kib(value: float) -> str:
    return f"{value / 1024:.1f}K" if value < 1024 * 1024 else f"{value / 1024 / 1024:.1f}M"


def print_table(report: dict[str, Any]) -> None:
    budget = report["window"] - report["reserve"]
    print(f"\nhistory cost: preparing turn N+1; window {report['window']} tokens, output reserve "
          f"{report['reserve']} (history budget about {budget - NOTE_RESERVE} tokens less system and input); "
          f"each exchange about {report['tokens_per_exchange']:.0f} tokens\n")
    header = (f"{'N':>6} | {'warm us':>8} {'rd':>4} | {'cold ms':>8} {'read':>7} {'files':>5} | "
              f"{'disk ms':>8} | {'cmp us':>7} {'cmp ms':>7} {'sum':>5} | "
              f"{'naive ms':>9} {'read':>7} {'files':>6} | {'sent ex':>7} {'naive msgs':>10}")
    print(header)
    print("-" * len(header))
    for size, row in report["sizes"].items():
        print(f"{int(size):>6} | {row['warm']['us']:8.1f} {row['warm']['bytes_per_turn']:4.0f} | "
              f"{row['cold']['ms']:8.2f} {kib(row['cold']['bytes']):>7} {row['cold']['files']:5d} | "
              f"{row['cold_disk']['ms']:8.2f} | {row['compacted']['warm_us']:7.1f} {row['compacted']['cold_ms']:7.2f} "
              f"{row['compacted']['sent']['summary_upto']:5d} | {row['naive']['ms']:9.2f} {kib(row['naive']['bytes']):>7} "
              f"{row['naive']['files']:6d} | {row['sent']['exchanges_sent']:7d} {row['naive']['messages']:10d}")
    print("\nwarm us: time to prepare the next turn with the conversation in memory (lowest median of 10 blocks); "
          "rd: bytes read per turn")
    print("cold: fresh cache (as after a restart), files in the page cache; disk: same, files evicted first")
    print("cmp: compaction on, a summary standing in for the left-out exchanges (warm us as above, cold ms, "
          "exchanges it covers)")
    print("naive: whole index + every response file, every turn (and it would send all of it: 'naive msgs')")
    for line in report["verdicts"]:
        print(line)


def verdicts(report: dict[str, Any]) -> list[str]:
    rows = report["sizes"]
    sizes = sorted(rows, key=int)
    small, large = rows[sizes[0]], rows[sizes[-1]]
    # sizes whose history exceeds the budget: the turn sends the same amount of history
    bound = [s for s in sizes if rows[s]["sent"]["exchanges_total"] > rows[s]["sent"]["exchanges_sent"]]
    lines = []
    if len(bound) >= 2:
        ratio = rows[bound[-1]]["warm"]["us"] / rows[bound[0]]["warm"]["us"]
        reads = max(rows[s]["warm"]["bytes_per_turn"] for s in sizes)
        lines.append(f"goal warm flat in N: N={bound[-1]} vs N={bound[0]} (both beyond the budget) = {ratio:.2f}x, "
                     f"{reads:.0f} bytes read per warm turn at most -> {'ok' if ratio < 1.5 and reads == 0 else 'MISSED'}"
                     f" (N={sizes[0]}: {small['warm']['us']:.1f} us, it sends only "
                     f"{small['sent']['exchanges_sent']} exchanges)")
    if len(bound) >= 2:
        ratio = rows[bound[-1]]["compacted"]["warm_us"] / rows[bound[0]]["compacted"]["warm_us"]
        lines.append(f"goal warm flat in N with compaction on: N={bound[-1]} vs N={bound[0]} = {ratio:.2f}x "
                     f"-> {'ok' if ratio < 1.5 else 'MISSED'}")
    if len(bound) >= 2:
        a, b = rows[bound[-2]], rows[bound[-1]]
        byte_ratio = b["cold"]["bytes"] / a["cold"]["bytes"]
        time_ratio = b["cold"]["ms"] / a["cold"]["ms"]
        lines.append(
            f"goal cold bounded by the budget: N={bound[-2]} -> N={bound[-1]}: bytes read x{byte_ratio:.2f}, "
            f"time x{time_ratio:.2f}, files {a['cold']['files']} -> {b['cold']['files']} "
            f"-> {'ok' if byte_ratio < 1.25 and time_ratio < 1.5 else 'MISSED'}")
    lines.append(f"naive baseline at N={sizes[-1]}: {large['naive']['ms']:.1f} ms and {kib(large['naive']['bytes'])} "
                 f"read per turn vs cold {large['cold']['ms']:.2f} ms / {kib(large['cold']['bytes'])} "
                 f"and warm {large['warm']['us']:.1f} us / 0 B")
    return lines


async def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [int(s) for s in args.sizes.split(",")]
    root = Path(tempfile.mkdtemp(prefix="history-", dir=args.dir))
    layout = VarLayout(root / "var")
    report: dict[str, Any] = {"window": args.window, "reserve": args.reserve, "sizes": {}, "tools": args.tools,
                              "machine": machine(loadavg=os.getloadavg()),
                              "data_dir": str(root)}
    try:
        built = {}
        for size in sizes:
            built[size] = await build(layout, f"conv-bench-{size}", size, seed=size, tools=args.tools)
            print(f"  built {size} exchanges in {built[size]['build_s']:.1f}s", file=sys.stderr, flush=True)
        report["tokens_per_exchange"] = statistics.mean(b["history_tokens"] / b["exchanges"] for b in built.values())
        for size in sizes:
            row = await measure(layout, f"conv-bench-{size}", args, size)
            row["built"] = built[size]
            report["sizes"][str(size)] = row
            print(f"  measured {size}", file=sys.stderr, flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    report["verdicts"] = verdicts(report)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10,100,1000,10000", help="exchanges per conversation")
    parser.add_argument("--window", type=int, default=8192, help="context window in tokens (default 8192)")
    parser.add_argument("--reserve", type=int, default=1024, help="output reserve in tokens (default 1024)")
    parser.add_argument("--warm-runs", type=int, default=500)
    parser.add_argument("--cold-runs", type=int, default=20)
    parser.add_argument("--disk-runs", type=int, default=5)
    parser.add_argument("--naive-runs", type=int, default=20)
    parser.add_argument("--dir", default=str(RESULTS_DIR), help="where to build the conversations")
    parser.add_argument("--keep", action="store_true", help="keep the built conversations")
    parser.add_argument("--tools", action="store_true", help="tool-using conversations (see above)")
    args = parser.parse_args()
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    report = asyncio.run(run(args))
    print_table(report)
    write_results("history_cost_tools" if args.tools else "history_cost", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
