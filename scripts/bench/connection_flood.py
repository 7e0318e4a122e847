"""The daemon with 2,000 idle and slow HTTP connections held open, against the same daemon without.

    .venv/bin/python scripts/bench/connection_flood.py [--connections 2000] [-n 1000] [--turns 200]
                                                       [--rounds 3] [--descriptors N]

Processes:
  daemon     `python -m ksi_daemon --quiet --http 127.0.0.1:PORT` (KSI_MAX_CONNECTIONS=5000, so
             every connection below is held, and KSI_HTTP_HEAD_TIMEOUT=600, so none times out
             while measured);
  flood      a local client holding `--connections` TCP connections to the HTTP port: half send
             nothing, half the first lines of a request head that never ends (no token needed);
  this one   the measuring client on the Unix socket.
With --descriptors N the daemon runs under `prlimit --nofile=N:N`: fewer descriptors than
connections, so the daemon must refuse some (503 too_many_connections) and keep serving.
Measured in each phase: `system:health` round trips on one connection (-n), a new connection's
connect + health (-n / 10), and completions on the echo model (--turns; completion:async then
completion:wait, one in flight). Goal: with the flood, the medians stay within 2x of the same
run without it. Rounds interleave the two phases, the order rotated; the table shows medians over
rounds. Prints a table and writes scripts/bench/results/connection_flood.json.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import Daemon, clean_env, free_port, machine, rotated, write_results

TOKEN = "bench-token-0123456789abcdef"
SLOW_HEAD = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n"
GOAL = 2.0


# -- role: flood ---------------------------------------------------------------------------------
def serve_flood(port: int, count: int) -> None:
    """Open `count` connections (every second one sends a head that never ends), print how many
    are held and how many the daemon refused, then hold them until stdin closes."""

    async def main() -> None:
        held: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        failed = 0
        for n in range(count):
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                failed += 1
                continue
            if n % 2:
                writer.write(SLOW_HEAD)
            held.append((reader, writer))
        # a refusal (or a close) arrives at once: those answered by now were not held
        endings = [asyncio.ensure_future(reader.read()) for reader, _writer in held]
        await asyncio.sleep(1.0)
        refused = sum(1 for ending in endings if ending.done())
        print(f"{len(held) - refused} {refused + failed}", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        for ending in endings:
            ending.cancel()
        for _reader, writer in held:
            writer.close()

    asyncio.run(main())


class Flood:
    """The flood role as a child process: its CPU and descriptors are not the measuring client's."""

    def __init__(self, port: int, count: int) -> None:
        self.process = subprocess.Popen([sys.executable, __file__, "--role", "flood", str(port), str(count)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=clean_env())
        assert self.process.stdout is not None
        held, refused = self.process.stdout.readline().split()
        self.held, self.refused = int(held), int(refused)

    def stop(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(30)


# -- measuring -----------------------------------------------------------------------------------
def median_and_p99(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


async def measure(daemon: Daemon, health_n: int, turns: int) -> dict[str, Any]:
    from ksi_common.client import KsiClient

    client = daemon.client
    health = []
    for _ in range(health_n):
        start = time.perf_counter()
        await client.request("system:health")
        health.append((time.perf_counter() - start) * 1e6)
    fresh = []
    for _ in range(max(1, health_n // 10)):
        start = time.perf_counter()
        async with KsiClient(daemon.socket) as other:
            await other.request("system:health")
        fresh.append((time.perf_counter() - start) * 1e6)
    completion = []
    for i in range(turns):
        start = time.perf_counter()
        ack = await client.request("completion:async", {"prompt": f"turn {i}", "model": "echo/bench"})
        result = await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 60})
        assert result.get("content"), result
        completion.append((time.perf_counter() - start) * 1e3)
    return {"health_us": median_and_p99(health), "connect_health_us": median_and_p99(fresh),
            "completion_ms": median_and_p99(completion)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="ksi-flood-"))
    launcher = ["prlimit", f"--nofile={args.descriptors}:{args.descriptors}", sys.executable, "-m", "ksi_daemon"] \
        if args.descriptors else []
    daemon = Daemon("http://127.0.0.1:9", workdir, args=["--http", f"127.0.0.1:{port}"], launcher=launcher,
                    env={"KSI_HTTP_TOKEN": TOKEN, "KSI_MAX_CONNECTIONS": "5000", "KSI_HTTP_HEAD_TIMEOUT": "600",
                         "KSI_FSYNC": "never", "KSI_LITELLM_PRELOAD": "false"})
    rounds: list[dict[str, Any]] = []
    try:
        await daemon.connect()
        await measure(daemon, 200, 20)  # warm-up: the tokenizer, the first conversation files
        for round_no in range(args.rounds):
            results: dict[str, Any] = {}
            for phase in rotated(["without", "with"], round_no):
                flood = Flood(port, args.connections) if phase == "with" else None
                try:
                    results[phase] = await measure(daemon, args.n, args.turns)
                    if flood is not None:
                        results["held"], results["refused"] = flood.held, flood.refused
                finally:
                    if flood is not None:
                        flood.stop()
            rounds.append(results)
            print(f"round {round_no + 1}: held {results['held']}, refused {results['refused']}", flush=True)
    finally:
        await daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return summarise(rounds, args)


def summarise(rounds: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for key, label, unit in (("health_us", "health round trip", "us"),
                             ("connect_health_us", "new connection + health", "us"),
                             ("completion_ms", "completion (echo)", "ms")):
        without = statistics.median(r["without"][key][0] for r in rounds)
        with_flood = statistics.median(r["with"][key][0] for r in rounds)
        without_p99 = statistics.median(r["without"][key][1] for r in rounds)
        with_p99 = statistics.median(r["with"][key][1] for r in rounds)
        ratio = with_flood / without
        rows.append({"measure": label, "unit": unit, "without": without, "with": with_flood,
                     "without_p99": without_p99, "with_p99": with_p99, "ratio": ratio, "goal_met": ratio <= GOAL})
    held = min(r["held"] for r in rounds)
    refused = max(r["refused"] for r in rounds)
    limit = f"descriptor limit {args.descriptors}" if args.descriptors else "the default descriptor limit"
    print(f"\n{args.connections} HTTP connections opened by a local client (half idle, half a head that never "
          f"ends), {limit}; held by the daemon: {held}, refused: {refused} (the worst round)\n")
    print(f"| measure | without | with {args.connections} | ratio (goal <= {GOAL:g}x) | p99 without | p99 with |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        unit = row["unit"]
        print(f"| {row['measure']} | {row['without']:.1f} {unit} | {row['with']:.1f} {unit} | {row['ratio']:.2f}x"
              f"{'' if row['goal_met'] else ' (missed)'} | {row['without_p99']:.1f} {unit} | "
              f"{row['with_p99']:.1f} {unit} |")
    return {"machine": machine(), "connections": args.connections, "descriptors": args.descriptors, "held": held,
            "refused": refused, "n": args.n, "turns": args.turns, "rounds": rounds, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--connections", type=int, default=2000)
    parser.add_argument("-n", type=int, default=1000, help="health round trips per phase")
    parser.add_argument("--turns", type=int, default=200, help="completions per phase")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--descriptors", type=int, default=0, help="the daemon's descriptor limit (prlimit)")
    args = parser.parse_args()
    if args.role:
        serve_flood(int(args.role[1]), int(args.role[2]))
        return
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        report = runner.run(run(args))
    write_results("connection_flood" + (f"_{args.descriptors}" if args.descriptors else ""), report)


if __name__ == "__main__":
    main()
