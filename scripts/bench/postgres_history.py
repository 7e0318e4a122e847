"""Preparing turn N+1 of an N-exchange conversation on PostgreSQL, N = 10 .. 10,000, warm and cold,
side by side with the same on JSONL files (issue 16: bounded by the token budget, flat in N).

    .venv/bin/python scripts/bench/postgres_history.py [--sizes 10,100,1000,10000] [--window 8192]

Each conversation is written through the storage ports (`import_conversation` on PostgreSQL,
`append_exchange` on files) with realistic exchange sizes, in a throwaway cluster
(tests/pg_cluster.py, fsync on). Turn N+1 is then prepared in this process the way the
completion service does it: the daemon's ConversationCache over the backend's stores, the
freshness probe a shared backend asks before each turn, `select_history` and `build_messages`
(budget = window - output reserve - system - new input - note reserve; no provider call):

  warm          the conversation in memory (the steady state): median time per turn, with the
                head probe a PostgreSQL daemon pays on every turn (one indexed query);
  cold          a fresh cache and a fresh connection pool, as after a daemon restart;
  cold server   the same after restarting the PostgreSQL server too (its buffers emptied;
                the OS page cache is not dropped).
It also reports how many exchanges a cold start loaded into memory (the tail within the budget),
the same for every N once N exceeds what the budget holds.
Prints a table and writes scripts/bench/results/postgres_history.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import machine, write_results

from ksi_common.ids import new_response_id
from ksi_common.layout import VarLayout
from ksi_common.records import IndexEntry
from ksi_common.timefmt import utc_now
from ksi_daemon.services.conversations.history import (
    MESSAGE_OVERHEAD,
    NOTE_RESERVE,
    build_messages,
    select_history,
)
from ksi_daemon.services.conversations.memory import ConversationCache, estimate_tokens
from ksi_daemon.storage.jsonl.conversations import JsonlConversations
from ksi_daemon.storage.jsonl.responses import JsonlResponses
from ksi_daemon.storage.models import ConversationMeta
from ksi_daemon.storage.postgres.conversations import PostgresConversations
from ksi_daemon.storage.postgres.database import Database
from ksi_daemon.storage.postgres.records import PostgresResponses
from tests.pg_cluster import ThrowawayCluster

MODEL = "openai/gpt-4o-mini"
SYSTEM = "You are a careful assistant. Answer briefly and remember what the user told you."
NEW_INPUT = "Given everything we discussed so far, what should I do next, and why?"
WORDS = ("the of and to in is that for it as was with be by on not this are or from at which but have "
         "an they you were there one all we can their has been if more when will would who so no model "
         "token budget context window history memory daemon conversation request response index").split()


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


def exchanges_of(conversation_id: str, size: int, seed: int) -> list[tuple[IndexEntry, list[dict[str, Any]]]]:
    rng = random.Random(seed)
    made = []
    for n in range(1, size + 1):
        response_id, ts = new_response_id(MODEL), utc_now()
        user = sentence(rng, rng.randint(20, 80))
        reply = " ".join(sentence(rng, rng.randint(10, 30)) for _ in range(rng.randint(3, 8)))
        tokens_in, tokens_out = estimate_tokens(user) + MESSAGE_OVERHEAD, estimate_tokens(reply) + MESSAGE_OVERHEAD
        lines = [
            {"v": 1, "type": "user", "content": user, "ts": ts, "request_id": f"req-{n:012x}",
             "conversation_id": conversation_id},
            {"v": 1, "type": "assistant", "content": reply, "model": MODEL, "provider": "openai",
             "usage": {"prompt_tokens": tokens_in, "completion_tokens": tokens_out}, "finish_reason": "stop",
             "ts": ts, "request_id": f"req-{n:012x}", "conversation_id": conversation_id},
        ]
        made.append((IndexEntry(n=n, response_id=response_id, ts=ts, model=MODEL, provider="openai",
                                tokens_in=tokens_in, tokens_out=tokens_out), lines))
    return made


class Backend:
    """One backend's stores, opened afresh for each cold measurement."""

    def __init__(self, name: str, layout: VarLayout, url: str | None) -> None:
        self.name, self.layout, self.url = name, layout, url
        self.database: Database | None = None

    async def open(self) -> tuple[Any, Any]:
        if self.url is None:
            return JsonlConversations(self.layout, fsync=False), JsonlResponses(self.layout, fsync=False)
        self.database = Database(self.url)
        await self.database.open()
        return PostgresConversations(self.database), PostgresResponses(self.database)

    async def close(self) -> None:
        if self.database is not None:
            await self.database.close()
            self.database = None


async def build(backend: Backend, conversation_id: str, size: int) -> float:
    started = time.perf_counter()
    conversations, _responses = await backend.open()
    exchanges = exchanges_of(conversation_id, size, seed=size)
    meta = ConversationMeta(conversation_id=conversation_id, system=SYSTEM, exchanges=size, models=[MODEL])
    if backend.url is None:
        for directory in (backend.layout.responses_dir, backend.layout.conversations_dir,
                          backend.layout.conversation_meta_dir):
            directory.mkdir(parents=True, exist_ok=True)
        await conversations.create(meta)
        for entry, lines in exchanges:
            await conversations.append_exchange(conversation_id, entry, response=lines)
    else:
        await conversations.import_conversation(meta, exchanges)
        async with backend.database.connection() as conn:  # type: ignore[union-attr]
            await conn.execute("ANALYZE")
    await backend.close()
    return time.perf_counter() - started


async def prepare(cache: ConversationCache, conversation_id: str, window: int, reserve: int) -> dict[str, int]:
    """The history part of the completion service's prepare, freshness probe included."""
    memory = await cache.require(conversation_id)
    system = memory.meta.system
    input_tokens = estimate_tokens(NEW_INPUT) + MESSAGE_OVERHEAD
    system_tokens = estimate_tokens(system) + MESSAGE_OVERHEAD if system else 0
    budget = window - reserve - system_tokens - input_tokens - NOTE_RESERVE
    memory = await cache.require(conversation_id, budget)
    history = await select_history(cache, memory, budget, 32)
    build_messages(system, history, [{"role": "user", "content": NEW_INPUT}])
    return {**history.stats(), "loaded": len(memory.entries)}


async def measure(backend: Backend, cluster: ThrowawayCluster, conversation_id: str,
                  args: argparse.Namespace) -> dict[str, Any]:
    row: dict[str, Any] = {}
    cold = []
    for attempt in range(args.cold_runs + 1):
        conversations, responses = await backend.open()
        cache = ConversationCache(conversations, responses, capacity=100)
        started = time.perf_counter()
        stats = await prepare(cache, conversation_id, args.window, args.reserve)
        elapsed = time.perf_counter() - started
        await backend.close()
        if attempt:
            cold.append(elapsed * 1000)
    row["cold_ms"] = statistics.median(cold)
    row["sent"] = stats
    if backend.url is not None:
        server = []
        for _ in range(args.server_runs):
            await asyncio.to_thread(cluster.stop)
            await asyncio.to_thread(cluster.start)
            conversations, responses = await backend.open()
            cache = ConversationCache(conversations, responses, capacity=100)
            started = time.perf_counter()
            await prepare(cache, conversation_id, args.window, args.reserve)
            server.append((time.perf_counter() - started) * 1000)
            await backend.close()
        row["cold_server_ms"] = statistics.median(server)
    conversations, responses = await backend.open()
    cache = ConversationCache(conversations, responses, capacity=100)
    await prepare(cache, conversation_id, args.window, args.reserve)
    blocks = []
    for _ in range(10):
        times = []
        for _ in range(max(1, args.warm_runs // 10)):
            started = time.perf_counter_ns()
            await prepare(cache, conversation_id, args.window, args.reserve)
            times.append((time.perf_counter_ns() - started) / 1000)
        blocks.append(statistics.median(times))
    await backend.close()
    row["warm_us"] = min(blocks)  # the quietest block: robust against other work on the machine
    return row


async def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [int(s) for s in args.sizes.split(",")]
    cluster = ThrowawayCluster(durable=True)
    cluster.start()
    workdir = Path(tempfile.mkdtemp(prefix="pg-history-"))
    report: dict[str, Any] = {"window": args.window, "reserve": args.reserve, "sizes": sizes, "rows": {},
                              "machine": machine(loadavg=os.getloadavg())}
    try:
        backends = [Backend("jsonl", VarLayout(workdir / "var"), None),
                    Backend("postgres", VarLayout(workdir / "unused"), cluster.url(cluster.create_database()))]
        for backend in backends:
            for size in sizes:
                seconds = await build(backend, f"h{size}", size)
                print(f"  built {backend.name} N={size} in {seconds:.1f}s", file=sys.stderr, flush=True)
        cluster.psql("CHECKPOINT")  # the build's writes are not charged to the first cold start
        for size in sizes:
            for backend in backends:
                report["rows"][f"{backend.name} {size}"] = await measure(backend, cluster, f"h{size}", args)
            print(f"  measured N={size}", file=sys.stderr, flush=True)
    finally:
        cluster.remove()
        shutil.rmtree(workdir, ignore_errors=True)
    report["verdicts"] = verdicts(report)
    return report


def verdicts(report: dict[str, Any]) -> list[str]:
    rows, sizes = report["rows"], report["sizes"]
    bound = [s for s in sizes if rows[f"postgres {s}"]["sent"]["exchanges_total"]
             > rows[f"postgres {s}"]["sent"]["exchanges_sent"]]
    if len(bound) < 2:
        return ["(no two sizes beyond the budget: use larger sizes)"]
    low, high = rows[f"postgres {bound[0]}"], rows[f"postgres {bound[-1]}"]
    lines = []
    for key, label in (("warm_us", "warm"), ("cold_ms", "cold"), ("cold_server_ms", "cold server")):
        ratio = high[key] / low[key]
        lines.append(f"postgres {label}: N={bound[-1]} vs N={bound[0]} = {ratio:.2f}x -> "
                     f"{'flat' if ratio < 1.5 else 'NOT flat'}")
    loaded = [rows[f'postgres {s}']['sent']['loaded'] for s in bound]
    sent = [rows[f'postgres {s}']['sent']['exchanges_sent'] for s in bound]
    lines.append(f"postgres cold start loads {loaded} exchanges for N in {bound} (history sent: {sent}) "
                 f"-> {'bounded by the budget' if all(a <= b + 1 for a, b in zip(loaded, sent)) else 'NOT bounded'}")
    return lines


def print_table(report: dict[str, Any]) -> None:
    print(f"\npreparing turn N+1: window {report['window']}, output reserve {report['reserve']}\n")
    header = (f"{'N':>6} | {'pg warm us':>10} {'pg cold ms':>10} {'pg srv ms':>9} {'loaded':>6} | "
              f"{'jsonl warm us':>13} {'jsonl cold ms':>13} | {'sent':>5} {'total':>6}")
    print(header)
    print("-" * len(header))
    for size in report["sizes"]:
        pg, files = report["rows"][f"postgres {size}"], report["rows"][f"jsonl {size}"]
        print(f"{size:>6} | {pg['warm_us']:10.1f} {pg['cold_ms']:10.2f} {pg['cold_server_ms']:9.2f} "
              f"{pg['sent']['loaded']:6d} | {files['warm_us']:13.1f} {files['cold_ms']:13.2f} | "
              f"{pg['sent']['exchanges_sent']:5d} {pg['sent']['exchanges_total']:6d}")
    print("\nwarm: in memory, the head probe included; cold: fresh cache and pool (a daemon restart); "
          "srv: the PostgreSQL server restarted too; loaded: exchanges a cold start read")
    for line in report["verdicts"]:
        print(line)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10,100,1000,10000")
    parser.add_argument("--window", type=int, default=8192)
    parser.add_argument("--reserve", type=int, default=1024)
    parser.add_argument("--warm-runs", type=int, default=300)
    parser.add_argument("--cold-runs", type=int, default=10)
    parser.add_argument("--server-runs", type=int, default=5)
    args = parser.parse_args()
    report = asyncio.run(run(args))
    print_table(report)
    write_results("postgres_history", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
