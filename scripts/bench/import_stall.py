"""What a large import costs everyone else: the latency of a small history-carrying request (an
HTTP chat completion whose client sends its earlier turns, so the door imports them first) while
a 5,000-exchange import runs, against the same request alone; and the import's own rate.

Per storage (JSONL and PostgreSQL, fsync always), one daemon subprocess on the stub:

  alone      the small request, one at a time, nothing else running
  import     a 5,000-exchange conversation:import alone: exchanges per second
  during     the small request, one at a time, from the moment a second large import is sent
             until it is answered; how many were answered before it, and their latency

The goal: a small request during the import within 3x of its latency alone (the median), and
answered while the import still runs. `--daemon-source DIR` runs the daemon from another checkout
(e.g. `git worktree add /tmp/before HEAD~3`) to measure the code before a change in the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from harness import RESULTS_DIR, ROOT, STUB_MODEL, Daemon, StubProcess, free_port, machine, serve_stub, write_results

from tests.pg_cluster import ThrowawayCluster

GOAL_RATIO = 3.0
TOKEN = "bench-token-0123456789abcdef"


def document(exchanges: int, tag: str) -> dict[str, Any]:
    """An export of `exchanges` exchanges of about 200 characters each way."""
    text = "lorem ipsum dolor sit amet " * 7
    return {"v": 1, "format": "ksi.conversation", "conversation": {"title": f"{tag}: {exchanges}"},
            "exchanges": [{"inputs": [{"type": "user", "content": f"{tag} {k} {text}"}],
                           "reply": {"content": f"answer {k} {text}", "model": "echo/x"}, "model": "echo/x"}
                          for k in range(exchanges)]}


async def small_request(http: httpx.AsyncClient, i: int) -> float:
    """One chat completion carrying two earlier turns; its latency in ms."""
    started = time.perf_counter()
    reply = await http.post("/v1/chat/completions", json={"model": STUB_MODEL, "messages": [
        {"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"},
        {"role": "user", "content": f"follow-up {i}"}]})
    elapsed = (time.perf_counter() - started) * 1000
    if reply.status_code != 200:
        raise RuntimeError(f"the small request failed: {reply.status_code} {reply.text[:300]}")
    return elapsed


async def timed_import(client: Any, data: dict[str, Any]) -> float:
    started = time.perf_counter()
    result = await client.request("conversation:import", {"data": data})
    assert result["exchanges"] == len(data["exchanges"]), result
    return time.perf_counter() - started


async def measure(daemon: Daemon, http_url: str, args: argparse.Namespace, label: str) -> dict[str, Any]:
    await daemon.connect()
    large = document(args.exchanges, "large")
    async with httpx.AsyncClient(base_url=http_url, timeout=600,
                                 headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        for i in range(5):
            await small_request(http, -1 - i)  # warm: litellm's import, the first connections
        alone = [await small_request(http, i) for i in range(args.alone)]
        import_s = await timed_import(daemon.client, large)
        during: list[float] = []  # every small request sent while the import ran, however long it waited
        answered = 0  # those answered before the import
        task = asyncio.create_task(timed_import(daemon.client, document(args.exchanges, "large-2")))
        while not task.done():
            during.append(await small_request(http, 10_000 + len(during)))
            answered += not task.done()
        during_import_s = await task
    row = {
        "storage": label,
        "alone_median_ms": statistics.median(alone), "alone_max_ms": max(alone),
        "during_median_ms": statistics.median(during) if during else None,
        "during_max_ms": max(during) if during else None,
        "sent_during_import": len(during), "answered_during_import": answered,
        "import_s": import_s, "import_exchanges_per_s": args.exchanges / import_s,
        "import_with_requests_s": during_import_s,
    }
    row["ratio"] = row["during_median_ms"] / row["alone_median_ms"] if during else None
    row["goal_met"] = bool(answered) and row["ratio"] <= GOAL_RATIO
    print(f"  {label} done", file=sys.stderr, flush=True)
    return row


async def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = RESULTS_DIR / "tmp"
    workdir.mkdir(parents=True, exist_ok=True)
    stub = StubProcess(__file__)
    cluster: ThrowawayCluster | None = None
    report: dict[str, Any] = {"exchanges": args.exchanges, "alone": args.alone, "daemon_source": args.daemon_source,
                              "machine": machine(loadavg_before=os.getloadavg()), "rows": []}
    source = {"PYTHONPATH": f"{args.daemon_source}:{ROOT}"} if args.daemon_source else {}
    try:
        for storage in args.storage.split(","):
            # a 5,000-exchange export is about 2.5 MB: over the socket line limit of 1 MiB
            env = {"KSI_FSYNC": "always", "KSI_HTTP_TOKEN": TOKEN, "KSI_LINE_LIMIT": str(64 << 20), **source}
            if storage == "postgres":
                if cluster is None:
                    cluster = ThrowawayCluster(durable=True)
                    cluster.start()
                env.update({"KSI_STORAGE": "postgres", "KSI_DATABASE_URL": cluster.url(cluster.create_database())})
            port = free_port()
            daemon = Daemon(stub.api_base, workdir, env, args=["--http", f"127.0.0.1:{port}"])
            try:
                report["rows"].append(await measure(daemon, f"http://127.0.0.1:{port}", args, storage))
            finally:
                await daemon.stop()
                shutil.rmtree(daemon.var_dir, ignore_errors=True)
    finally:
        stub.stop()
        if cluster is not None:
            cluster.remove()
    report["machine"]["loadavg_after"] = os.getloadavg()
    return report


def print_table(report: dict[str, Any]) -> None:
    print(f"\nA small history-carrying chat completion while a {report['exchanges']}-exchange import runs "
          f"(fsync always; daemon from {report['daemon_source'] or 'this checkout'})\n")
    print(f"{'storage':<10} {'alone ms':>9} {'during ms':>10} {'max ms':>8} {'ratio':>6} {'sent':>5} {'answered':>9} "
          f"{'import s':>9} {'exch/s':>8} {'goal':>5}")
    for row in report["rows"]:
        during = f"{row['during_median_ms']:.1f}" if row["during_median_ms"] is not None else "-"
        top = f"{row['during_max_ms']:.0f}" if row["during_max_ms"] is not None else "-"
        ratio = f"{row['ratio']:.2f}" if row["ratio"] is not None else "-"
        print(f"{row['storage']:<10} {row['alone_median_ms']:>9.1f} {during:>10} {top:>8} {ratio:>6} "
              f"{row['sent_during_import']:>5} {row['answered_during_import']:>9} {row['import_s']:>9.2f} "
              f"{row['import_exchanges_per_s']:>8.0f} "
              f"{'yes' if row['goal_met'] else 'no':>5}")
    print(f"\ngoal: during/alone median <= {GOAL_RATIO}, and requests answered while the import runs "
          "(sent: small requests sent while it ran; answered: of them, before it)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=["stub"], help=argparse.SUPPRESS)
    parser.add_argument("--exchanges", type=int, default=5000, help="exchanges of the large import")
    parser.add_argument("--alone", type=int, default=30, help="small requests measured alone")
    parser.add_argument("--storage", default="jsonl,postgres", help="comma-separated: jsonl, postgres")
    parser.add_argument("--daemon-source", help="run the daemon from this checkout instead")
    args = parser.parse_args()
    if args.role == "stub":
        serve_stub()
        return 0
    if args.daemon_source:
        args.daemon_source = str(Path(args.daemon_source).resolve())
    report = asyncio.run(run(args))
    print_table(report)
    write_results("import_stall" + ("_source" if args.daemon_source else ""), report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
