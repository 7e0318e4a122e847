"""Finding the conversation a client-held history belongs to, against importing that history
(issue 30: flat in the number of stored conversations, below the cost of an import).

    .venv/bin/python scripts/bench/history_match.py [--turns 10,100,1000] [--stores 100,1000,10000]
                                                    [--reps 7] [--storage jsonl,postgres]

An in-process daemon (no socket traffic, no provider call) on a fresh var dir (or a throwaway
PostgreSQL cluster, fsync on) is filled with conversations through `conversation:import`: for
each history length T a target conversation of T exchanges, and "other" conversations of 2 to 4
exchanges whose first exchange is, for half of them, the same as the targets' (so a lookup by the
first digest alone would find thousands). After each store size S, for each T:

  match    the completion service resolving a request whose `history` is the target's T
           exchanges (split, canonical form and chain of T digests, one lookup of the newest,
           the candidate checked): it must name the target conversation; median of `reps`, the
           conversation already in memory (as a client's next turn finds it);
  import   the baseline: `conversation:import` of the same T exchanges (what a history that
           matches nothing costs, and what every turn cost before digests); median of `reps`.

A last row per backend restarts the daemon on the full store and times the first match (the JSONL
lookup log is read once then; PostgreSQL asks its index). Prints a table, writes
scripts/bench/results/history_match.json.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import machine, rotated, write_results

from ksi_common.settings import Settings
from ksi_daemon.context import EventContext
from ksi_daemon.daemon import Daemon
from ksi_daemon.logs import configure_logging
from ksi_daemon.services.completion.models import CompletionAsync

FIRST = ("Hello! Can you help me plan a trip?", "Of course. Where would you like to go, and when?")


def turn_texts(seed: int, count: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    words = "the trip budget train hotel museum food weather week day plan city walk river old town".split()
    return [(" ".join(rng.choice(words) for _ in range(rng.randint(8, 30))) + f" ({seed}.{i})?",
             " ".join(rng.choice(words) for _ in range(rng.randint(20, 60))) + ".") for i in range(count)]


def document(pairs: list[tuple[str, str]]) -> dict[str, Any]:
    return {"format": "ksi.conversation", "v": 1, "conversation": {"system": "You plan trips."},
            "exchanges": [{"inputs": [{"type": "user", "content": u}], "reply": {"content": a}} for u, a in pairs]}


def history(pairs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = [{"role": "system", "content": "You plan trips."}]
    for user, reply in pairs:
        items += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    return items


async def no_check(_data: CompletionAsync) -> None:
    return None


async def timed_match(daemon: Daemon, items: list[dict[str, Any]]) -> tuple[float, str | None]:
    data = CompletionAsync(prompt="And next?", history=items)
    start = time.perf_counter()
    resolved = await daemon.completion.admission.client_history.resolve(data, EventContext.root(), no_check)
    return time.perf_counter() - start, resolved.conversation_id


async def timed_import(daemon: Daemon, pairs: list[tuple[str, str]]) -> float:
    start = time.perf_counter()
    imported = await daemon.router.request("conversation:import", {"data": document(pairs)}, EventContext.root())
    elapsed = time.perf_counter() - start
    await daemon.router.request("conversation:delete", {"conversation_id": imported["conversation_id"]},
                                EventContext.root())
    return elapsed


async def fill(daemon: Daemon, start: int, stop: int) -> None:
    for i in range(start, stop):
        rng = random.Random(i)
        pairs = turn_texts(10_000_000 + i, rng.randint(2, 4))
        if i % 2 == 0:
            pairs[0] = FIRST
        await daemon.router.request("conversation:import", {"data": document(pairs), "new_id": f"other-{i}"},
                                    EventContext.root())


class SettingsPerStore:
    """The settings of the daemon holding each store size: a var dir, or a database, of its own."""

    def __init__(self, work: Path, cluster: Any) -> None:
        self.work = work
        self.cluster = cluster  # a tests.pg_cluster.ThrowawayCluster, or None for JSONL
        self.databases: dict[int, str] = {}

    def __call__(self, size: int) -> Settings:
        overrides: dict[str, Any] = {"var_dir": self.work / f"var-{size}", "socket_path": self.work / f"d-{size}.sock",
                                     "litellm_preload": False}
        if self.cluster is not None:
            if size not in self.databases:
                self.databases[size] = self.cluster.url(self.cluster.create_database())
            overrides.update(storage="postgres", database_url=self.databases[size])
        return Settings(_env_file=None, **overrides)


async def run_backend(storage: str, settings_for: Any, turns: list[int], stores: list[int],
                      reps: int) -> list[dict[str, Any]]:
    """One daemon per store size, filled, then `reps` rounds in which each daemon (in rotated
    order) matches and imports each history once: noise from other work falls on every size alike."""
    targets = {t: [FIRST, *turn_texts(t, t - 1)] for t in turns}
    daemons: dict[int, Daemon] = {}
    try:
        for size in stores:
            daemon = daemons[size] = Daemon(settings_for(size))
            await daemon.start()
            started = time.perf_counter()
            for t, pairs in targets.items():
                await daemon.router.request("conversation:import", {"data": document(pairs), "new_id": f"target-{t}"},
                                            EventContext.root())
            await fill(daemon, 0, size)
            print(f"  [{storage}] {size:,} conversations stored in {time.perf_counter() - started:.1f} s", flush=True)
        matches: dict[tuple[int, int], list[float]] = {(s, t): [] for s in stores for t in turns}
        imports: dict[tuple[int, int], list[float]] = {(s, t): [] for s in stores for t in turns}
        for round_no in range(reps):
            for size in rotated(stores, round_no):
                for t, pairs in targets.items():
                    elapsed, found = await timed_match(daemons[size], history(pairs))
                    assert found == f"target-{t}", (found, t)
                    matches[size, t].append(elapsed)
                    imports[size, t].append(await timed_import(daemons[size], pairs))
    finally:
        for daemon in daemons.values():
            await daemon.shutdown()
    rows: list[dict[str, Any]] = []
    for size in stores:
        for t in turns:
            row = {"storage": storage, "stored": size + len(turns), "turns": t,
                   "match_ms": statistics.median(matches[size, t]) * 1000,
                   "import_ms": statistics.median(imports[size, t]) * 1000}
            row["ratio"] = row["match_ms"] / row["import_ms"]
            rows.append(row)
            print(f"  {storage:8} {row['stored']:>7,} {t:>6} {row['match_ms']:>10.2f} {row['import_ms']:>10.2f} "
                  f"{row['ratio']:>7.3f}", flush=True)
    largest, t = stores[-1], turns[-1]
    daemon = Daemon(settings_for(largest))  # a restart: the first match after it
    await daemon.start()
    try:
        elapsed, found = await timed_match(daemon, history(targets[t]))
        assert found == f"target-{t}"
        rows.append({"storage": storage, "stored": largest + len(turns), "turns": t,
                     "first_after_restart_ms": elapsed * 1000})
        print(f"  {storage:8} first match after a restart ({t} turns, {largest:,} stored): {elapsed * 1000:.1f} ms")
    finally:
        await daemon.shutdown()
    return rows


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", default="10,100,1000")
    parser.add_argument("--stores", default="100,1000,10000")
    parser.add_argument("--reps", type=int, default=9, help="rounds (medians are reported)")
    parser.add_argument("--storage", default="jsonl")
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="ksi-match-log-"))
    configure_logging(logs / "daemon.log", "WARNING", 10_000_000, 1, console=False)  # the table only
    turns = [int(x) for x in args.turns.split(",")]
    stores = [int(x) for x in args.stores.split(",")]
    print(f"  {'storage':8} {'stored':>7} {'turns':>6} {'match ms':>10} {'import ms':>10} {'ratio':>7}")
    rows: list[dict[str, Any]] = []
    for storage in args.storage.split(","):
        work = Path(tempfile.mkdtemp(prefix="ksi-match-"))
        cluster = None
        try:
            if storage == "postgres":
                from tests.pg_cluster import ThrowawayCluster

                cluster = ThrowawayCluster(durable=True)
                cluster.start()
            rows += await run_backend(storage, SettingsPerStore(work, cluster), turns, stores, args.reps)
        finally:
            if cluster is not None:
                cluster.remove()
            shutil.rmtree(work, ignore_errors=True)
    flat = {}
    for storage in args.storage.split(","):
        for t in turns:
            by_size = [r["match_ms"] for r in rows if r["storage"] == storage and r["turns"] == t and "match_ms" in r]
            flat[f"{storage}/{t}"] = max(by_size) / min(by_size)
    print("\n  largest / smallest match time across store sizes (flat: near 1): "
          + ", ".join(f"{k} {v:.2f}x" for k, v in flat.items()))
    shutil.rmtree(logs, ignore_errors=True)
    write_results("history_match", {"machine": machine(), "rows": rows, "flatness": flat,
                                    "goal": "match flat in stored conversations and below the import (ratio < 1)"})


if __name__ == "__main__":
    asyncio.run(main())
