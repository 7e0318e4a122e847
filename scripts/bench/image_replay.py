"""What sending a stored image again costs the event loop: the longest the loop waits while a turn
rebuilds a large image part (`Images.chat_part`: the blob read, checked against its hash and
encoded as a data URL), against the same loop idle and against the same encoding done as one
base64 call in a worker thread.

Per round, rotated, on the JSONL blob store of a throwaway var dir:

  idle        the loop with nothing to do: its own jitter on this machine (the baseline)
  one call    base64 of the whole image in one call in a worker thread (base64 holds the
              interpreter lock while it runs, so the loop waits for it anyway)
  first turn  `chat_part` of an image not yet encoded
  later turn  `chat_part` of the same image again (served from the data URL cache)

The goal: the worst stall of a first turn under half of the one-call stall, and a later turn's
under 2x the idle loop's.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from harness import machine, rotated, write_results

from ksi_daemon.services.completion.file_roots import FileRoots
from ksi_daemon.services.completion.images import Images
from ksi_daemon.storage.backends import build_storage
from tests.conftest import make_settings
from tests.image_bytes import png

FIRST_GOAL = 0.5  # of the one-call stall
LATER_GOAL = 2.0  # of the idle loop's


async def worst_stall(work: Callable[[], Awaitable[Any]]) -> float:
    """The longest the loop went without running a 1 ms ticker while `work` ran, in ms."""
    worst, running = 0.0, True

    async def ticker() -> None:
        nonlocal worst
        last = time.perf_counter()
        while running:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            worst = max(worst, now - last - 0.001)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.02)
    worst = 0.0
    await work()
    running = False
    await task
    return worst * 1000


async def run(megabytes: int, rounds: int) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="ksi-bench-"))
    storage = build_storage(make_settings(root))
    await storage.open()
    try:
        data = png(8, 8) + bytes(range(256)) * (megabytes * 1024 * 1024 // 256)
        ref = (await storage.blobs.put(data, "image/png")).to_record()
        part = {"type": "input_image", "image": ref}
        images = Images(storage.blobs, FileRoots([root]), len(data) + 1)

        async def first() -> None:
            images.data_urls = type(images.data_urls)(images.data_urls.limit)  # nothing encoded yet
            await images.chat_part(part)

        players: dict[str, Callable[[], Awaitable[Any]]] = {
            "idle": lambda: asyncio.sleep(0.1),
            "one call": lambda: asyncio.to_thread(base64.b64encode, data),
            "first turn": first,
            "later turn": lambda: images.chat_part(part),
        }
        await images.chat_part(part)  # warm: the file in the page cache for every round alike
        stalls: dict[str, list[float]] = {name: [] for name in players}
        for round_no in range(rounds):
            for name in rotated(list(players), round_no):
                stalls[name].append(await worst_stall(players[name]))
        return {name: statistics.median(values) for name, values in stalls.items()} | {"rounds": stalls}
    finally:
        await storage.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    report = asyncio.run(run(args.megabytes, args.rounds))
    print(f"{args.megabytes} MB image, worst event-loop stall, median of {args.rounds} rounds")
    print(f"{'':12} {'ms':>8}")
    for name in ("idle", "one call", "first turn", "later turn"):
        print(f"{name:12} {report[name]:8.1f}")
    first_ratio = report["first turn"] / report["one call"]
    later_ratio = report["later turn"] / max(report["idle"], 0.001)
    print(f"\nfirst turn / one call: {first_ratio:.2f} (goal under {FIRST_GOAL})")
    print(f"later turn / idle:     {later_ratio:.2f} (goal under {LATER_GOAL})")
    write_results("image_replay", {"machine": machine(), "megabytes": args.megabytes, **report,
                                   "first_ratio": first_ratio, "later_ratio": later_ratio,
                                   "goals": {"first_ratio": FIRST_GOAL, "later_ratio": LATER_GOAL}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
