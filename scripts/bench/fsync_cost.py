"""What durability costs: completions/s, latency and daemon CPU per exchange with KSI_FSYNC=always
against KSI_FSYNC=never, both daemons measured in one run, interleaved.

    .venv/bin/python scripts/bench/fsync_cost.py [--exchanges 1000] [--reps 3]

The fsync policy measured here (ksi_daemon/storage/jsonl):
  always  per exchange, in a worker thread: one line (response lines, index line, and the metadata
          of a conversation made for it) appended to state/exchange-log/N.jsonl, fsync(file)
          (and fsync(state/exchange-log/) when the generation is new); then the response file,
          the index line and any metadata written without fsync; only then is completion:result
          emitted. Every two seconds one syncfs makes those files durable and the generation is
          removed. The request journal (state/requests.jsonl) is appended without fsync.
  never   the same writes without any fsync: a killed daemon loses nothing (the kernel has the
          data), a power loss may lose the last exchanges.
The echo/ model answers (no network), so the difference is the storage path plus the daemon's own
work; each mode runs the same workload: 20 conversations concurrently, each sequential
(async + wait), then one conversation strictly sequential for latency.
Prints a table and writes scripts/bench/results/fsync_cost.json.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
from harness import rotated, write_results

from ksi_common.client import KsiClient
from tests.test_crash import DaemonProcess, daemon_env

MODES = ("always", "never")


async def chain(client: KsiClient, conversation_id: str, count: int, latencies: list[float] | None) -> None:
    for k in range(count):
        started = time.perf_counter()
        ack = await client.request("completion:async", {"prompt": f"message {k}", "model": "echo/bench",
                                                        "conversation_id": conversation_id, "create": True})
        await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 60})
        if latencies is not None:
            latencies.append(time.perf_counter() - started)


async def measure(daemon: DaemonProcess, exchanges: int, conversations: int, tag: str) -> dict[str, Any]:
    process = psutil.Process(daemon.process.pid)  # type: ignore[union-attr]
    per = max(1, exchanges // conversations)
    async with KsiClient(daemon.socket) as client:
        cpu = process.cpu_times()
        started = time.perf_counter()
        await asyncio.gather(*(chain(client, f"{tag}-c{c}", per, None) for c in range(conversations)))
        wall = time.perf_counter() - started
        cpu_after = process.cpu_times()
        done = per * conversations
        latencies: list[float] = []
        await chain(client, f"{tag}-seq", max(50, exchanges // 5), latencies)
    cpu_used = (cpu_after.user - cpu.user) + (cpu_after.system - cpu.system)
    return {
        "exchanges": done,
        "completions_per_s": done / wall,
        "cpu_ms_per_exchange": cpu_used * 1000 / done,
        "sequential_median_ms": statistics.median(latencies) * 1000,
        "sequential_p95_ms": sorted(latencies)[int(len(latencies) * 0.95) - 1] * 1000,
    }


async def run(exchanges: int, conversations: int, reps: int) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="kfs-", dir="/tmp"))
    daemons: dict[str, DaemonProcess] = {}
    try:
        for mode in MODES:
            (root / mode).mkdir()
            env = daemon_env("http://127.0.0.1:9/v1", KSI_FSYNC=mode, KSI_DEFAULT_MODEL="echo/bench",
                             KSI_LOG_LEVEL="WARNING")
            daemons[mode] = DaemonProcess(root / mode, env)
            await daemons[mode].start()
            await measure(daemons[mode], 100, 10, f"warm{mode}")  # first calls pay lazy imports
        samples: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
        for rep in range(reps):
            for mode in rotated(MODES, rep):
                sample = await measure(daemons[mode], exchanges, conversations, f"r{rep}")
                samples[mode].append(sample)
                print(f"  rep {rep + 1} fsync={mode:<6} {sample['completions_per_s']:8.0f}/s  "
                      f"{sample['cpu_ms_per_exchange']:6.2f} ms CPU  "
                      f"seq median {sample['sequential_median_ms']:6.2f} ms", flush=True)
    finally:
        for daemon in daemons.values():
            await daemon.stop()
        shutil.rmtree(root, ignore_errors=True)
    summary = {mode: {key: statistics.median(s[key] for s in samples[mode]) for key in samples[mode][0]}
               for mode in MODES}
    return {"samples": samples, "median": summary}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--exchanges", type=int, default=1000, help="exchanges per measurement")
    parser.add_argument("--conversations", type=int, default=20)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    result = asyncio.run(run(args.exchanges, args.conversations, args.reps))
    always, never = result["median"]["always"], result["median"]["never"]
    rows = [
        ("completions/s (20 conversations)", "completions_per_s", "{:.0f}"),
        ("daemon CPU per exchange (ms)", "cpu_ms_per_exchange", "{:.3f}"),
        ("sequential exchange, median (ms)", "sequential_median_ms", "{:.2f}"),
        ("sequential exchange, p95 (ms)", "sequential_p95_ms", "{:.2f}"),
    ]
    print(f"\n{'median of ' + str(args.reps) + ' reps':<36}{'fsync=always':>14}{'fsync=never':>14}{'always/never':>14}")
    for label, key, fmt in rows:
        ratio = always[key] / never[key] if never[key] else float("nan")
        print(f"{label:<36}{fmt.format(always[key]):>14}{fmt.format(never[key]):>14}{ratio:>14.2f}")
    write_results("fsync_cost", {"args": vars(args), "machine": {"cpus": psutil.cpu_count(),
                                                                 "python": platform.python_version()}, **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
