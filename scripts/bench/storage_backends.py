"""Turns per second and the daemon's CPU per completion, JSONL vs PostgreSQL, one daemon vs two on
one database (issue 16: under 2 ms of the daemon's own CPU per completion on PostgreSQL).

    .venv/bin/python scripts/bench/storage_backends.py [-n 200] [--repeats 3] [--conversations 9]
                                                        [--concurrency 8]

Separate processes, so each CPU figure belongs to one process only:
  stub     tests/stub_openai.py, a local OpenAI-compatible server (never counted);
  direct   the baseline: a process making the same chat calls with litellm itself (the
           `direct` role of completion_overhead.py); CPU is its time.process_time();
  daemons  real `python -m ksi_daemon --quiet` subprocesses; CPU is psutil user+system of each
           daemon pid, summed over the daemons of a configuration (the JSON also has each
           daemon's share and how many completions it served);
  server   a throwaway PostgreSQL cluster (tests/pg_cluster.py) with fsync and synchronous
           commit ON, as a production server would run; its CPU (every server process) is shown
           apart, never added to the daemon's.
Configurations, each warmed up first (litellm's import excluded):
  jsonl never / jsonl always   one daemon on a var dir, KSI_FSYNC=never / always;
  postgres 1                   one daemon, KSI_STORAGE=postgres;
  postgres 2 alternating       two daemons on one database; turn k of every conversation goes to
                               daemon k % 2, so every turn follows the other daemon's: each cache
                               finds the head moved and reloads (the worst case for caches);
  postgres 2 split             two daemons on one database, each with its own conversations.
Two passes per configuration and round, rounds interleaved with the order rotated:
  sequential   N completions one at a time over C conversations (history within the budget);
               daemon CPU per completion, and the same minus the direct baseline's CPU per call
               for the same messages: the daemon's own overhead; and the database calls per
               completion (each daemon's `system:health` storage.database_calls, read around it);
  concurrent   N completions with `--concurrency` in flight: turns per second.
Prints a table and writes scripts/bench/results/storage_backends.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import time
from typing import Any

import completion_overhead  # its stub and direct roles serve this bench too
from harness import RESULTS_DIR, Daemon, StubProcess, machine, postgres_cpu_s, prompt, rotated, write_results

from tests.pg_cluster import ThrowawayCluster

GOAL_PG_MS = 2.0
GOAL_JSONL_MS = 1.0


class Configuration:
    """A named set of daemons and the rule that sends turn k of conversation c to one of them."""

    def __init__(self, name: str, daemons: list[Daemon], alternate: bool) -> None:
        self.name = name
        self.daemons = daemons
        self.alternate = alternate

    def daemon_for(self, conversation: int, turn: int) -> Daemon:
        if len(self.daemons) == 1:
            return self.daemons[0]
        if self.alternate:
            return self.daemons[turn % 2]
        return self.daemons[conversation % 2]

    def cpu_s(self) -> float:
        return sum(d.cpu_s() for d in self.daemons)


async def one_turn(client: Any, conversation_id: str, text: str) -> None:
    ack = await client.request("completion:async", {"prompt": text, "conversation_id": conversation_id,
                                                    "create": True})
    for _ in range(10):  # a loaded machine: the first turn also waits for litellm's import
        result = await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 60})
        if "content" in result:
            return
    raise RuntimeError(f"completion did not finish: {result}")


async def database_calls(config: Configuration) -> int:
    """Units of work the configuration's daemons have run on the database so far (0 for JSONL)."""
    total = 0
    for daemon in config.daemons:
        storage = (await daemon.clients[0].request("system:health"))["storage"]
        total += storage.get("database_calls", 0)
    return total


async def sequential(config: Configuration, count: int, offset: int, conversations: int, tag: str,
                     server: Any) -> dict[str, float]:
    turns = [0] * conversations
    calls0 = await database_calls(config)
    served = [0] * len(config.daemons)
    each0 = [d.cpu_s() for d in config.daemons]
    cpu0, server0, wall0 = config.cpu_s(), postgres_cpu_s(server), time.perf_counter()
    for i in range(count):
        c = i % conversations
        daemon = config.daemon_for(c, turns[c])
        await one_turn(daemon.clients[0], f"sb-{tag}-{c}", prompt(offset + i))
        served[config.daemons.index(daemon)] += 1
        turns[c] += 1
    cpu, wall, server_cpu = config.cpu_s() - cpu0, time.perf_counter() - wall0, postgres_cpu_s(server) - server0
    # read after the clock stops: the health requests are not part of the turns measured
    calls = await database_calls(config) - calls0
    return {"cpu_ms": cpu * 1000 / count, "wall_ms": wall * 1000 / count, "server_cpu_ms": server_cpu * 1000 / count,
            "database_calls": calls / count,
            # with two daemons: what each spent, over all N completions, and how many it served
            "cpu_ms_by_daemon": [(d.cpu_s() - c0) * 1000 / count for d, c0 in zip(config.daemons, each0, strict=True)],
            "served_by_daemon": served}


async def concurrent(config: Configuration, count: int, offset: int, tag: str, concurrency: int,
                     server: Any) -> dict[str, float]:
    """`concurrency` workers, each continuing a conversation of its own, until `count` turns are done."""
    started = 0
    cpu0, server0, wall0 = config.cpu_s(), postgres_cpu_s(server), time.perf_counter()

    async def worker(w: int) -> None:
        nonlocal started
        turn = 0
        while started < count:
            started += 1
            daemon = config.daemon_for(w, turn)
            await one_turn(daemon.clients[w % len(daemon.clients)], f"sbc-{tag}-{w}", prompt(offset + started))
            turn += 1

    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    wall = time.perf_counter() - wall0
    return {"turns_per_s": started / wall, "cpu_ms": (config.cpu_s() - cpu0) * 1000 / started,
            "server_cpu_ms": (postgres_cpu_s(server) - server0) * 1000 / started}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = RESULTS_DIR / "tmp"
    workdir.mkdir(parents=True, exist_ok=True)
    stub = StubProcess(completion_overhead.__file__)
    api_base = stub.api_base
    cluster = ThrowawayCluster(durable=True)
    cluster.start()
    report: dict[str, Any] = {
        "n": args.n, "repeats": args.repeats, "conversations": args.conversations, "concurrency": args.concurrency,
        "machine": machine(loadavg_before=os.getloadavg()),
    }
    direct = completion_overhead.start_direct(api_base, args.conversations)
    configs: list[Configuration] = []
    try:
        direct.batch("chat", args.warmup, 10_000_000)
        pg1 = cluster.url(cluster.create_database())
        pg2 = cluster.url(cluster.create_database())
        pg3 = cluster.url(cluster.create_database())
        postgres = {"KSI_STORAGE": "postgres", "KSI_FSYNC": "always"}
        specs = [
            ("jsonl never", [{"KSI_FSYNC": "never"}], False),
            ("jsonl always", [{"KSI_FSYNC": "always"}], False),
            ("postgres 1", [{**postgres, "KSI_DATABASE_URL": pg1}], False),
            ("postgres 2 alternating", [{**postgres, "KSI_DATABASE_URL": pg2}] * 2, True),
            ("postgres 2 split", [{**postgres, "KSI_DATABASE_URL": pg3}] * 2, False),
        ]
        for name, envs, alternate in specs:
            configs.append(Configuration(name, [Daemon(api_base, workdir, env) for env in envs], alternate))
        for config in configs:
            for daemon in config.daemons:
                await daemon.connect(args.concurrency)
            await sequential(config, args.warmup, 20_000_000, args.conversations, f"warm-{config.name[:3]}", None)
        runs: dict[str, dict[str, list[dict[str, float]]]] = {c.name: {"sequential": [], "concurrent": []}
                                                              for c in configs}
        runs["direct"] = {"chat": []}
        players: list[Any] = ["direct", *configs]
        for r in range(args.repeats):
            for player in rotated(players, r):
                if player == "direct":
                    runs["direct"]["chat"].append(await asyncio.to_thread(direct.batch, "chat", args.n, r * args.n))
                    continue
                tag = f"{player.name.replace(' ', '')}-{r}"
                runs[player.name]["sequential"].append(
                    await sequential(player, args.n, r * args.n, args.conversations, tag, cluster))
                runs[player.name]["concurrent"].append(
                    await concurrent(player, args.n, r * args.n, tag, args.concurrency, cluster))
            print(f"  round {r + 1}/{args.repeats} done", file=sys.stderr, flush=True)
        report["runs"] = runs
    finally:
        for config in configs:
            for daemon in config.daemons:
                await daemon.stop()
                shutil.rmtree(daemon.var_dir, ignore_errors=True)
        direct.close()
        stub.stop()
        cluster.remove()
    report["machine"]["loadavg_after"] = os.getloadavg()
    report["rows"] = summarize(report)
    return report


def summarize(report: dict[str, Any]) -> list[dict[str, Any]]:
    runs = report["runs"]
    direct = runs["direct"]["chat"]
    rows = [{"what": "direct litellm (chat loop)", "cpu_ms": statistics.median(r["cpu_ms"] for r in direct),
             "wall_ms": statistics.median(r["wall_ms"] for r in direct)}]
    for name, passes in runs.items():
        if name == "direct":
            continue
        seq, conc = passes["sequential"], passes["concurrent"]
        overhead = statistics.median(s["cpu_ms"] - d["cpu_ms"] for s, d in zip(seq, direct, strict=True))
        goal = GOAL_PG_MS if name.startswith("postgres") else GOAL_JSONL_MS
        rows.append({
            "what": name, "cpu_ms": statistics.median(s["cpu_ms"] for s in seq),
            "wall_ms": statistics.median(s["wall_ms"] for s in seq), "overhead_ms": overhead,
            "server_cpu_ms": statistics.median(s["server_cpu_ms"] for s in seq),
            "database_calls": statistics.median(s["database_calls"] for s in seq),
            "turns_per_s": statistics.median(c["turns_per_s"] for c in conc),
            "concurrent_cpu_ms": statistics.median(c["cpu_ms"] for c in conc),
            "goal_ms": goal, "goal_met": overhead < goal,
        })
    return rows


def print_table(report: dict[str, Any]) -> None:
    print(f"\nstorage backends: {report['repeats']} interleaved rounds; sequential N={report['n']} over "
          f"{report['conversations']} conversations; concurrent N={report['n']} with {report['concurrency']} in flight\n")
    header = (f"{'configuration':<26} | {'CPU ms':>7} {'own ms':>7} {'goal':>6} | {'wall ms':>7} | "
              f"{'server ms':>9} {'db calls':>8} | {'turns/s':>8} {'CPU ms':>7}")
    print(header)
    print("-" * len(header))
    for row in report["rows"]:
        if "overhead_ms" not in row:
            print(f"{row['what']:<26} | {row['cpu_ms']:7.2f} {'':>7} {'':>6} | {row['wall_ms']:7.2f} | {'':>9} "
                  f"{'':>8} | {'':>8} {'':>7}")
            continue
        verdict = f"<{row['goal_ms']:.0f} {'ok' if row['goal_met'] else 'NO'}"
        print(f"{row['what']:<26} | {row['cpu_ms']:7.2f} {row['overhead_ms']:7.2f} {verdict:>6} | "
              f"{row['wall_ms']:7.2f} | {row['server_cpu_ms']:9.2f} {row['database_calls']:8.2f} | "
              f"{row['turns_per_s']:8.1f} "
              f"{row['concurrent_cpu_ms']:7.2f}")
    print("\nCPU ms: daemon CPU per completion, sequential (summed over the configuration's daemons); own ms: "
          "minus the direct litellm CPU per call for the same messages (the daemon's own cost)")
    print("server ms: PostgreSQL server CPU per completion (not counted in the daemon's); db calls: units of "
          "work the daemons ran on the database per completion (system:health storage.database_calls); "
          "turns/s and its CPU ms: the concurrent pass")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=200, help="completions per pass")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=9, help="conversations of the sequential pass")
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    report = asyncio.run(run(args))
    print_table(report)
    write_results("storage_backends", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
