"""Daemon memory under load: RSS with 10,000 queued requests and with 1,000 subscribers connected,
each against the idle RSS of the same daemon measured in the same run.

    .venv/bin/python scripts/bench/load_memory.py [--queued 10000] [--conversations 1000] [--subscribers 1000]

(a) queued: a subprocess daemon (default settings: max_queued 10,000, max_concurrency 8) whose
    provider, a local stub, holds every answer; after a warm-up completion the idle RSS is taken,
    then --queued completion:async requests over --conversations conversations are acknowledged
    (8 running, the rest waiting) and the RSS is taken again; one more request must be refused
    with `overloaded` (the queue is bounded, it does not grow).
(b) subscribers: a second daemon (echo model), idle RSS after a warm-up, then --subscribers
    connections each with monitor:subscribe ["completion:*"]; RSS with them connected, and again
    after 10 completions were pushed to every one of them (each subscriber must get them all).
Prints a table and writes scripts/bench/results/load_memory.json.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import psutil
from harness import write_results

from ksi_common.client import KsiClient
from ksi_common.errors import KsiError
from tests.stub_openai import StubOpenAI
from tests.test_crash import DaemonProcess, daemon_env

MB = 1024 * 1024


class HoldingStub(StubOpenAI):
    """Answers at once until `holding` is set; then every answer waits for `release`."""

    def __init__(self) -> None:
        super().__init__()
        self.holding = False
        self.release = asyncio.Event()

    async def _chat(self, request: Any) -> Any:
        if self.holding:
            await self.release.wait()
        return await super()._chat(request)


async def rss_settled(pid: int, seconds: float = 1.5) -> int:
    """RSS once the daemon has been quiet a moment (freed memory returned, threads idle)."""
    await asyncio.sleep(seconds)
    return psutil.Process(pid).memory_info().rss


async def one_completion(socket_path: Path, **data: Any) -> None:
    async with KsiClient(socket_path) as client:
        ack = await client.request("completion:async", {"prompt": "warm up", **data})
        await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 60})


async def queued_scenario(root: Path, queued: int, conversations: int) -> dict[str, Any]:
    async with HoldingStub() as stub:
        daemon = DaemonProcess(root, daemon_env(stub.api_base, KSI_LOG_LEVEL="WARNING"))
        await daemon.start()
        pid = daemon.process.pid  # type: ignore[union-attr]
        try:
            await one_completion(daemon.socket)
            idle = await rss_settled(pid)
            stub.holding = True
            started = time.perf_counter()
            connections = 10
            per_connection = queued // connections

            async def submit(index: int) -> None:
                async with KsiClient(daemon.socket) as client:
                    for start in range(0, per_connection, 200):
                        batch = range(index * per_connection + start,
                                      index * per_connection + min(per_connection, start + 200))
                        await asyncio.gather(*(client.request("completion:async", {
                            "prompt": f"request {n}", "conversation_id": f"c{n % conversations}", "create": True})
                            for n in batch))

            await asyncio.gather(*(submit(i) for i in range(connections)))
            submit_seconds = time.perf_counter() - started
            async with KsiClient(daemon.socket) as client:
                health = (await client.request("system:health"))["completions"]
                try:
                    await client.request("completion:async", {"prompt": "one too many"})
                    refused = None
                except KsiError as error:
                    refused = {"code": error.code, "retry_after": error.details.get("retry_after")}
            loaded = await rss_settled(pid)
        finally:
            daemon.kill()
            stub.release.set()
    return {"idle_rss": idle, "loaded_rss": loaded, "queued": health["queued"], "running": health["running"],
            "submit_seconds": submit_seconds, "one_more": refused}


async def subscribers_scenario(root: Path, subscribers: int) -> dict[str, Any]:
    daemon = DaemonProcess(root, daemon_env("http://127.0.0.1:9/v1", KSI_DEFAULT_MODEL="echo/bench",
                                            KSI_LOG_LEVEL="WARNING"))
    await daemon.start()
    pid = daemon.process.pid  # type: ignore[union-attr]
    streams: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        await one_completion(daemon.socket)
        idle = await rss_settled(pid)
        subscribe = orjson.dumps({"event": "monitor:subscribe", "data": {"patterns": ["completion:*"]},
                                  "correlation_id": "s"}) + b"\n"
        for _ in range(subscribers):
            reader, writer = await asyncio.open_unix_connection(str(daemon.socket))
            writer.write(subscribe)
            streams.append((reader, writer))
        for reader, _writer in streams:
            reply = orjson.loads(await reader.readline())
            assert "subscription_id" in reply["data"], reply
        connected = await rss_settled(pid)
        async with KsiClient(daemon.socket) as client:
            health = await client.request("system:health")
        completions = 10
        started = time.perf_counter()
        for _ in range(completions):
            await one_completion(daemon.socket)

        async def drain(reader: asyncio.StreamReader) -> int:
            results = 0
            while results < completions:
                frame = orjson.loads(await asyncio.wait_for(reader.readline(), 60))
                results += frame.get("event") == "completion:result"
            return results

        received = await asyncio.gather(*(drain(reader) for reader, _w in streams))
        fan_out_seconds = time.perf_counter() - started
        pushed = await rss_settled(pid)
    finally:
        for _reader, writer in streams:
            writer.close()
        await daemon.stop()
    return {"idle_rss": idle, "connected_rss": connected, "after_pushes_rss": pushed,
            "subscriptions": health["subscriptions"], "connections": health["connections"],
            "results_received": sum(received), "results_expected": completions * subscribers,
            "fan_out_seconds": fan_out_seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queued", type=int, default=10_000)
    parser.add_argument("--conversations", type=int, default=1000)
    parser.add_argument("--subscribers", type=int, default=1000)
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4 * args.subscribers + 256)), hard))
    root = Path(tempfile.mkdtemp(prefix="klm-", dir="/tmp"))
    try:
        (root / "q").mkdir()
        (root / "s").mkdir()
        queued = asyncio.run(queued_scenario(root / "q", args.queued, args.conversations))
        gc.collect()
        subs = asyncio.run(subscribers_scenario(root / "s", args.subscribers))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    waiting = queued["queued"] + queued["running"]
    rows = [
        ("daemon A idle (litellm loaded)", queued["idle_rss"], None, None),
        (f"daemon A, {waiting:,} queued ({queued['running']} running)", queued["loaded_rss"],
         queued["loaded_rss"] - queued["idle_rss"], waiting),
        ("daemon B idle (litellm loaded)", subs["idle_rss"], None, None),
        (f"daemon B, {subs['subscriptions']:,} subscribers connected", subs["connected_rss"],
         subs["connected_rss"] - subs["idle_rss"], subs["subscriptions"]),
        (f"daemon B, after {subs['results_expected'] * 2:,} pushes", subs["after_pushes_rss"],
         subs["after_pushes_rss"] - subs["idle_rss"], subs["subscriptions"]),
    ]
    print(f"\n{'':<46}{'RSS MB':>9}{'vs idle MB':>12}{'KB each':>10}")
    for label, rss, delta, count in rows:
        extra = f"{delta / MB:>12.1f}{delta / 1024 / count:>10.1f}" if delta is not None else ""
        print(f"{label:<46}{rss / MB:>9.1f}{extra}")
    print(f"\nacknowledged {waiting:,} requests in {queued['submit_seconds']:.1f}s; one more: {queued['one_more']}")
    print(f"pushed {subs['results_received']:,}/{subs['results_expected']:,} results to "
          f"{subs['subscriptions']:,} subscribers in {subs['fan_out_seconds']:.2f}s")
    write_results("load_memory", {"args": vars(args), "queued": queued, "subscribers": subs})
    ok = (queued["one_more"] or {}).get("code") == "overloaded" and \
        subs["results_received"] == subs["results_expected"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
