"""Several daemons on one database (issue 32): takeover time after SIGKILL against the heartbeat
timeout (the lease set alike), and turns per second for one, two and three daemons.

    .venv/bin/python scripts/bench/pool_bench.py [--timeouts 2,5] [--turns 200] [--hold 0.2] [--limit 8]

Separate processes: the stub (tests/stub_openai.py answering every call after `--hold` seconds),
real `python -m ksi_daemon --quiet` daemons with KSI_STORAGE=postgres, and a throwaway PostgreSQL
cluster with fsync on.
  takeover   two daemons; a turn is acknowledged by A, which is killed (SIGKILL) at once; the time
             from the kill to B's `completion:wait` returning its result, against the turn's own
             time on a live daemon measured in the same run (the baseline). Goal: within the
             timeout + 1 s beyond the baseline.
  throughput `--turns` turns on as many conversations, spread over N daemons (each with
             KSI_MAX_CONCURRENCY=`--limit`), all sent at once: turns/s for N = 1, 2, 3, each as a
             ratio to N = 1 (goal close to N), and the database calls per turn (each daemon's
             storage.database_calls, read around the pass).
  stealing   the same turns all sent to one of the N daemons: the others claim what it has no slot
             for (work stealing); turns/s for N = 1, 2, 3 as a ratio to N = 1 (goal close to N),
             database calls per turn, and how many turns the other daemons ran.
Prints a table and writes scripts/bench/results/pool_bench.json.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import ROOT, Daemon, machine, write_results

sys.path.insert(0, str(ROOT))
from tests.pg_cluster import ThrowawayCluster  # noqa: E402

STUB_HOLD_ENV = "KSI_BENCH_STUB_HOLD"


def serve_slow_stub(hold: float) -> None:
    """`--role stub`: the stub answering every call after `hold` seconds; prints its api_base."""
    from tests.stub_openai import StubOpenAI

    async def main() -> None:
        async with StubOpenAI() as server:
            server.hold = hold
            print(server.api_base, flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)

    asyncio.run(main())


class SlowStub:
    def __init__(self, hold: float) -> None:
        import subprocess

        from harness import stub_env

        self.process = subprocess.Popen([sys.executable, __file__, "--role", "stub", "--hold", str(hold)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=stub_env(),
                                        cwd=ROOT)
        assert self.process.stdout is not None
        self.api_base = self.process.stdout.readline().strip()

    def stop(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(10)


def pool_env(url: str, **extra: str) -> dict[str, str]:
    return {"KSI_STORAGE": "postgres", "KSI_DATABASE_URL": url, "KSI_SUMMARISER": "off", **extra}


async def started(api_base: str, workdir: Path, env: dict[str, str], count: int) -> list[Daemon]:
    daemons = []
    for _ in range(count):  # one at a time: the first migrates the database
        daemon = Daemon(api_base, workdir, env)
        await daemon.connect(timeout=180)
        await daemon.client.request("completion:async", {"prompt": "warm up", "create": True})  # litellm loaded
        daemons.append(daemon)
    for daemon in daemons:
        for _ in range(600):
            if (await daemon.client.request("system:health"))["litellm_loaded"]:
                break
            await asyncio.sleep(0.1)
    return daemons


async def takeover(api_base: str, workdir: Path, cluster: ThrowawayCluster, timeout: float) -> dict[str, Any]:
    url = cluster.url(cluster.create_database())
    env = pool_env(url, KSI_HEARTBEAT_INTERVAL=str(min(0.5, timeout / 3)), KSI_HEARTBEAT_TIMEOUT=str(timeout),
                   KSI_POOL_LEASE=str(timeout))
    a, b = await started(api_base, workdir, env, 2)
    try:
        began = time.perf_counter()
        ack = await b.client.request("completion:async", {"prompt": "baseline", "conversation_id": "base", "create": True})
        await b.client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 60})
        baseline = time.perf_counter() - began
        ack = await a.client.request("completion:async", {"prompt": "taken over", "conversation_id": "t", "create": True})
        a.process.kill()
        killed = time.perf_counter()
        a.process.wait()
        result = await b.client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 120})
        elapsed = time.perf_counter() - killed
        assert result["response_id"] == ack["response_id"]
    finally:
        a.clients.clear()
        await a.stop()
        await b.stop()
    return {"timeout_s": timeout, "baseline_turn_s": round(baseline, 3), "takeover_s": round(elapsed, 3),
            "beyond_baseline_s": round(elapsed - baseline, 3), "goal_s": timeout + 1.0,
            "met": elapsed - baseline <= timeout + 1.0}


async def throughput(api_base: str, workdir: Path, cluster: ThrowawayCluster, count: int, turns: int,
                     limit: int, to_one: bool = False) -> dict[str, Any]:
    url = cluster.url(cluster.create_database())
    daemons = await started(api_base, workdir, pool_env(url, KSI_MAX_CONCURRENCY=str(limit)), count)
    try:
        calls_before = [(await d.client.request("system:health"))["storage"]["database_calls"] for d in daemons]
        began = time.perf_counter()

        async def one(i: int) -> None:
            client = daemons[0 if to_one else i % count].client
            ack = await client.request("completion:async", {"prompt": f"turn {i}", "conversation_id": f"c{i}",
                                                            "create": True})
            await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 600})

        await asyncio.gather(*(one(i) for i in range(turns)))
        elapsed = time.perf_counter() - began
        storage_after = [(await d.client.request("system:health"))["storage"] for d in daemons]
    finally:
        for daemon in daemons:
            await daemon.stop()
    calls_after = [after["database_calls"] for after in storage_after]
    calls = sum(after - before for before, after in zip(calls_before, calls_after, strict=True))
    return {"daemons": count, "sent_to": "one" if to_one else "all", "turns": turns, "seconds": round(elapsed, 3),
            "turns_per_s": round(turns / elapsed, 2), "database_calls_per_turn": round(calls / turns, 2),
            "claimed_by_others": sum(after["requests_stolen"] for after in storage_after)}


async def main(args: argparse.Namespace) -> None:
    cluster = ThrowawayCluster(durable=True)
    cluster.start()
    workdir = Path(tempfile.mkdtemp(prefix="ksi-pool-bench-"))
    stub = SlowStub(args.hold)
    try:
        takeovers = [await takeover(stub.api_base, workdir, cluster, float(t)) for t in args.timeouts.split(",")]
        passes = [await throughput(stub.api_base, workdir, cluster, n, args.turns, args.limit) for n in (1, 2, 3)]
        stealing = [await throughput(stub.api_base, workdir, cluster, n, args.turns, args.limit, to_one=True)
                    for n in (1, 2, 3)]
    finally:
        stub.stop()
        cluster.remove()
        shutil.rmtree(workdir, ignore_errors=True)
    for rows in (passes, stealing):
        one = rows[0]["turns_per_s"]
        for row in rows:
            row["ratio_to_one"] = round(row["turns_per_s"] / one, 2)
    print(f"\ntakeover after SIGKILL (stub holds each call {args.hold} s)")
    print(f"{'timeout s':>10} {'baseline s':>11} {'takeover s':>11} {'beyond s':>9} {'goal s':>7}  met")
    for row in takeovers:
        print(f"{row['timeout_s']:>10} {row['baseline_turn_s']:>11} {row['takeover_s']:>11} "
              f"{row['beyond_baseline_s']:>9} {row['goal_s']:>7}  {row['met']}")
    print(f"\n{args.turns} turns on {args.turns} conversations, KSI_MAX_CONCURRENCY={args.limit} per daemon")
    print(f"{'sent to':>8} {'daemons':>8} {'seconds':>8} {'turns/s':>8} {'x one':>6} {'db calls/turn':>14} "
          f"{'run by others':>14}")
    for row in [*passes, *stealing]:
        print(f"{row['sent_to']:>8} {row['daemons']:>8} {row['seconds']:>8} {row['turns_per_s']:>8} "
              f"{row['ratio_to_one']:>6} {row['database_calls_per_turn']:>14} {row['claimed_by_others']:>14}")
    write_results("pool_bench", {"machine": machine(), "hold_s": args.hold, "takeover": takeovers,
                                 "throughput": passes, "stealing": stealing})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=["stub"])
    parser.add_argument("--hold", type=float, default=0.2)
    parser.add_argument("--timeouts", default="2,5")
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--limit", type=int, default=8)
    parsed = parser.parse_args()
    if parsed.role == "stub":
        serve_slow_stub(parsed.hold)
    else:
        asyncio.run(main(parsed))
