"""Many agents at once: 1,000 agents x 10 turns, 50 in flight, against the instant stub, beside a
direct `litellm.acompletion` loop at the same concurrency in the same run.

    .venv/bin/python scripts/bench/many_agents.py [--agents 1000] [--turns 10] [--in-flight 50]
                                                  [--rounds 1] [--tmpfs /dev/shm] [--disk DIR]

Goals (issue 29): the daemon's turns per second at least 0.8x the direct loop's, with its var dir on
tmpfs; its peak RSS under 300 MB. The same run with the var dir on the default file system
(`--disk`, default scripts/bench/results/tmp) is reported beside it.

Separate processes, so each CPU figure belongs to one process only:
  stub    tests/stub_openai.py answering at once (its CPU is never counted);
  direct  the baseline: 1,000 chats kept by the process itself (each turn appends the user
          message, sends the whole list with `litellm.acompletion(..., max_retries=0)`, appends the
          reply), 50 calls in flight, on uvloop as in the daemon;
  daemon  a real `python -m ksi_daemon --quiet` (KSI_FSYNC=never, KSI_MAX_CONCURRENCY=50 so that
          the daemon lets as many provider calls run as the baseline makes; its default is 8),
          driven by this process over 10 socket connections.
An agent is what a KSI user spawns: `agent:spawn` (no profile: the daemon's default model, the
stub), then each turn `agent:send_message` with `wait: true`, which queues the message in the
agent's conversation and answers with the reply (the daemon rebuilds the history each turn).
Spawning the 1,000 agents is timed apart and not counted in the turns.

Turns are scheduled alike on both sides: 50 workers take the next agent from one queue, make one
turn, and put the agent back at the end while it has turns left, so all 1,000 conversations are
alive at once and no agent has two turns in flight.

Per round (players in rotated order; each daemon is new, warmed with a few completions first):
turns per second over the turn phase, CPU per turn (the daemon process's CPU clock, all threads;
the direct process's process_time), the client's own CPU per turn (this process, driving the
daemon), and the daemon's peak RSS (VmHWM, after the run). "own CPU x litellm" is the daemon's
CPU per turn minus the direct process's CPU per call, over the latter.

Prints a table and writes scripts/bench/results/many_agents.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from harness import (
    RESULTS_DIR,
    STUB_MODEL,
    Daemon,
    DirectWorker,
    StubProcess,
    machine,
    prompt,
    quiet_litellm,
    rotated,
    serve_batches,
    serve_stub,
    write_results,
)

GOAL_RATIO = 0.8
GOAL_RSS_MB = 300.0
CONNECTIONS = 10
WARMUP = 50


async def run_turns(agents: int, turns: int, in_flight: int, turn: Callable[[int, int], Awaitable[None]]) -> None:
    """agents x turns calls of turn(agent, i), `in_flight` at a time, an agent never in two at once:
    workers take the next agent from one queue and put it back at the end while it has turns left."""
    ready: deque[int] = deque(range(agents))
    done = [0] * agents

    async def worker() -> None:
        while ready:
            agent = ready.popleft()
            await turn(agent, done[agent])
            done[agent] += 1
            if done[agent] < turns:
                ready.append(agent)

    # more workers than agents could find the queue empty while an agent is still in flight
    await asyncio.gather(*(worker() for _ in range(min(in_flight, agents))))


# -- role: direct litellm baseline ------------------------------------------------------------
def serve_direct(api_base: str, turns: int, in_flight: int) -> None:
    """Each `agents COUNT OFFSET` line: COUNT chats x `turns` turns, `in_flight` calls at a time;
    answers with turns/s and CPU per call."""
    litellm = quiet_litellm()

    async def batch(_shape: str, count: int, offset: int) -> dict[str, float]:
        chats: list[list[dict[str, str]]] = [[] for _ in range(count)]

        async def turn(agent: int, i: int) -> None:
            chat = chats[agent]
            chat.append({"role": "user", "content": prompt(offset + agent * turns + i)})
            response = await litellm.acompletion(model=STUB_MODEL, api_base=api_base, api_key="x",
                                                 messages=list(chat), max_retries=0)
            chat.append({"role": "assistant", "content": response.choices[0].message.content or ""})

        cpu0, wall0 = time.process_time(), time.perf_counter()
        await run_turns(count, turns, in_flight, turn)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        calls = count * turns
        return {"turns_per_s": calls / wall, "cpu_ms_per_turn": cpu * 1000 / calls, "wall_s": wall}

    serve_batches(batch)


# -- the daemon -------------------------------------------------------------------------------
def peak_rss_mb(pid: int) -> float:
    """The process's peak resident set (VmHWM), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def daemon_round(api_base: str, workdir: Path, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    """A new daemon with its var dir in `workdir`: warm-up, spawn the agents, drive their turns."""
    env = {"KSI_FSYNC": "never", "KSI_MAX_CONCURRENCY": str(args.in_flight), "KSI_LOG_LEVEL": "WARNING"}
    daemon = Daemon(api_base, workdir, env)
    try:
        await daemon.connect(CONNECTIONS)
        clients = daemon.clients
        for i in range(WARMUP):  # litellm loaded, its HTTP client pooled
            ack = await daemon.client.request("completion:async", {"prompt": prompt(10_000_000 + i)})
            await daemon.client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 60})
        rss_warm = daemon.ps.memory_info().rss / 2**20
        ids = [f"a{tag}-{n}" for n in range(args.agents)]

        cpu0, wall0 = daemon.cpu_s(), time.perf_counter()
        for start in range(0, args.agents, args.in_flight):
            await asyncio.gather(*(clients[n % CONNECTIONS].request("agent:spawn", {"agent_id": ids[n]})
                                   for n in range(start, min(start + args.in_flight, args.agents))))
        spawn_wall, spawn_cpu = time.perf_counter() - wall0, daemon.cpu_s() - cpu0

        async def turn(agent: int, i: int) -> None:
            reply = await clients[agent % CONNECTIONS].request("agent:send_message", {
                "agent_id": ids[agent], "message": prompt(agent * args.turns + i), "wait": 60})
            if "content" not in reply:
                raise RuntimeError(f"turn did not finish: {reply}")

        client_cpu0, cpu0, wall0 = time.process_time(), daemon.cpu_s(), time.perf_counter()
        await run_turns(args.agents, args.turns, args.in_flight, turn)
        wall, cpu = time.perf_counter() - wall0, daemon.cpu_s() - cpu0
        client_cpu = time.process_time() - client_cpu0
        calls = args.agents * args.turns
        return {"turns_per_s": calls / wall, "cpu_ms_per_turn": cpu * 1000 / calls, "wall_s": wall,
                "client_cpu_ms_per_turn": client_cpu * 1000 / calls,
                "spawn_per_s": args.agents / spawn_wall, "spawn_cpu_ms": spawn_cpu * 1000 / args.agents,
                "rss_warm_mb": rss_warm, "rss_end_mb": daemon.ps.memory_info().rss / 2**20,
                "peak_rss_mb": peak_rss_mb(daemon.process.pid)}
    finally:
        await daemon.stop()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    places = {"tmpfs": args.tmpfs, "disk": args.disk or RESULTS_DIR / "tmp"}
    workdirs = {}
    for name, root in places.items():
        root.mkdir(parents=True, exist_ok=True)
        workdirs[name] = Path(tempfile.mkdtemp(prefix="many-agents-", dir=root))
    from completion_overhead import file_system

    report: dict[str, Any] = {
        "agents": args.agents, "turns": args.turns, "in_flight": args.in_flight, "rounds": args.rounds,
        "model": STUB_MODEL, "connections": CONNECTIONS,
        "machine": machine(loadavg_before=os.getloadavg(),
                           file_systems={name: f"{file_system(d)} ({places[name]})" for name, d in workdirs.items()}),
    }
    stub = StubProcess(__file__)
    direct = DirectWorker(__file__, "--api-base", stub.api_base, "--turns", str(args.turns),
                          "--in-flight", str(args.in_flight))
    runs: dict[str, list[dict[str, Any]]] = {"direct": [], "tmpfs": [], "disk": []}
    try:
        direct.batch("agents", WARMUP, 10_000_000)
        for r in range(args.rounds):
            for name in rotated(list(runs), r):
                if name == "direct":
                    result = await asyncio.to_thread(direct.batch, "agents", args.agents, r * args.agents)
                else:
                    result = await daemon_round(stub.api_base, workdirs[name], args, f"{r}")
                runs[name].append(result)
                print(f"  round {r + 1}/{args.rounds} {name}: {result['turns_per_s']:.0f} turns/s",
                      file=sys.stderr, flush=True)
    finally:
        direct.close()
        stub.stop()
        for workdir in workdirs.values():
            shutil.rmtree(workdir, ignore_errors=True)
    report["runs"] = runs
    report["machine"]["loadavg_after"] = os.getloadavg()
    return report


def summarize(report: dict[str, Any]) -> list[dict[str, Any]]:
    runs = report["runs"]
    direct = runs["direct"]
    rows = [{"what": "direct litellm.acompletion loop", "turns_per_s": med(direct, "turns_per_s"),
             "cpu_ms_per_turn": med(direct, "cpu_ms_per_turn")}]
    for name in ("tmpfs", "disk"):
        mine = runs[name]
        rows.append({
            "what": f"daemon, var dir on {name}",
            "turns_per_s": med(mine, "turns_per_s"), "cpu_ms_per_turn": med(mine, "cpu_ms_per_turn"),
            "ratio": statistics.median([m["turns_per_s"] / d["turns_per_s"] for m, d in zip(mine, direct, strict=True)]),
            "own_share": statistics.median([(m["cpu_ms_per_turn"] - d["cpu_ms_per_turn"]) / d["cpu_ms_per_turn"]
                                            for m, d in zip(mine, direct, strict=True)]),
            "client_cpu_ms_per_turn": med(mine, "client_cpu_ms_per_turn"),
            "peak_rss_mb": max(m["peak_rss_mb"] for m in mine), "rss_warm_mb": med(mine, "rss_warm_mb"),
            "spawn_per_s": med(mine, "spawn_per_s"), "spawn_cpu_ms": med(mine, "spawn_cpu_ms"),
        })
        rows[-1]["goal"] = rows[-1]["ratio"] >= GOAL_RATIO and rows[-1]["peak_rss_mb"] < GOAL_RSS_MB
    return rows


def med(results: list[dict[str, Any]], key: str) -> float:
    return statistics.median([r[key] for r in results])


def print_table(report: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    m = report["machine"]
    print(f"\nmany agents: {report['agents']} agents x {report['turns']} turns, {report['in_flight']} in flight, "
          f"{report['rounds']} round(s) (median shown), instant stub; load average {m['loadavg_before'][0]:.1f} "
          f"before, {m['loadavg_after'][0]:.1f} after, {m['cpus']} CPUs; var dirs: "
          f"{', '.join(f'{k} = {v}' for k, v in m['file_systems'].items())}\n")
    header = (f"{'what':32} {'turns/s':>8} {'x direct':>9} {'CPU ms/turn':>12} {'own x litellm':>14} "
              f"{'client ms/turn':>15} {'peak RSS MB':>12} {'spawns/s':>9}  goal >= {GOAL_RATIO}x, < {GOAL_RSS_MB:g} MB")
    print(header)
    print("-" * len(header))
    for row in rows:
        cells = [f"{row['what']:32}", f"{row['turns_per_s']:8.0f}"]
        if "ratio" in row:
            cells += [f"{row['ratio']:9.2f}", f"{row['cpu_ms_per_turn']:12.3f}", f"{row['own_share']:+14.2f}",
                      f"{row['client_cpu_ms_per_turn']:15.3f}", f"{row['peak_rss_mb']:12.1f}",
                      f"{row['spawn_per_s']:9.0f}", " " + ("ok" if row["goal"] else "MISSED")]
        else:
            cells += [f"{'':9}", f"{row['cpu_ms_per_turn']:12.3f}"]
        print(" ".join(cells))
    print("'own x litellm': (daemon CPU per turn - direct CPU per call) / direct CPU per call, per round; "
          "'client ms/turn': this process's CPU driving the daemon (on the same cores)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=("bench", "stub", "direct"), default="bench", help=argparse.SUPPRESS)
    parser.add_argument("--api-base", help=argparse.SUPPRESS)
    parser.add_argument("--agents", type=int, default=1000)
    parser.add_argument("--turns", type=int, default=10, help="turns per agent (default 10)")
    parser.add_argument("--in-flight", type=int, default=50, help="turns in flight at once (default 50)")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds (default 1)")
    parser.add_argument("--tmpfs", type=Path, default=Path("/dev/shm"), help="a tmpfs for the first daemon's var dir")
    parser.add_argument("--disk", type=Path, help="the second daemon's var dir root (default scripts/bench/results/tmp)")
    args = parser.parse_args()
    if args.role == "stub":
        serve_stub()
        return 0
    if args.role == "direct":
        serve_direct(args.api_base, args.turns, args.in_flight)
        return 0
    report = asyncio.run(run(args))
    rows = summarize(report)
    report["table"] = rows
    print_table(report, rows)
    write_results("many_agents", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
