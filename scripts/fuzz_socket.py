"""A longer fuzzing run against one in-process daemon: random bytes, random JSON lines and hostile
data for every registered event, values past their bounds and damaged conversation exports (the
strategies and checks of tests/test_fuzz.py and tests/test_fuzz_integrity.py).

    .venv/bin/python scripts/fuzz_socket.py [--examples 2000] [--seed N]

A "crash" is any example after which the daemon broke a rule: a reply that is not a structured
error with a known code, a traceback in a reply, no reply at all, system:health not answering,
or a file written outside var/. Every example runs to the end (no shrinking); the first few
failures are printed with their payloads. Exit status 1 when anything was found.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.test_fuzz import (  # noqa: E402
    SKIPPED_EVENTS,
    FuzzBox,
    FuzzFailure,
    assert_alive,
    encode_line,
    escapes,
    event_payloads,
    fuzz_box,
    json_values,
    probe,
    probe_event,
    random_bytes,
    tree_outside,
)
from tests.test_fuzz_integrity import bounded_payloads, damaged_imports, probe_bounded, probe_import  # noqa: E402


class Runner:
    """The daemon's loop in a thread; hypothesis in the main thread sends it one probe at a time."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.stop = asyncio.Event()
        self.box: FuzzBox | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        async with fuzz_box() as box:
            self.box = box
            self.ready.set()
            await self.stop.wait()

    def start(self) -> FuzzBox:
        self.thread.start()
        self.ready.wait(60)
        assert self.box is not None, "the daemon did not start"
        return self.box

    def call(self, coro: Any, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=2000, help="hypothesis examples to run")
    parser.add_argument("--seed", type=int, default=None, help="make the run repeatable")
    args = parser.parse_args()

    runner = Runner()
    box = runner.start()
    counts: collections.Counter[str] = collections.Counter()
    codes: collections.Counter[str] = collections.Counter()
    failures: list[tuple[str, str]] = []
    started = time.perf_counter()

    def record(kind: str, payload: Any, run: Any) -> None:
        counts["examples"] += 1
        counts[kind] += 1
        try:
            result = runner.call(run)
            for frame in result.frames:
                if isinstance(frame, dict) and "error" in frame:
                    codes[frame["error"]["code"]] += 1
            runner.call(assert_alive(box.socket))
        except (FuzzFailure, TimeoutError, StopIteration) as failure:
            counts["crashes"] += 1
            failures.append((kind, f"{type(failure).__name__}: {failure}"[:800] + f"\n    payload: {payload!r}"[:600]))

    @settings(max_examples=args.examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(choice=st.integers(0, 4), data=st.data())
    def fuzz(choice: int, data: st.DataObject) -> None:
        if choice == 0:
            payload = data.draw(random_bytes)
            record("random_bytes", payload, probe(box.socket, payload))
        elif choice == 1:
            frame = data.draw(json_values)
            if isinstance(frame, dict) and frame.get("event") in SKIPPED_EVENTS:
                return
            ascii_only = data.draw(st.booleans())
            record("random_json", frame, probe(box.socket, encode_line(frame, ascii_only)))
        elif choice == 3:  # a value past its bound, or a provider option that would pick a host
            event, payload, field = data.draw(bounded_payloads())
            record(f"bounded {event}", payload, probe_bounded(box, event, payload, field))
        elif choice == 4:  # a conversation export damaged anywhere
            document = data.draw(damaged_imports())
            record("damaged_import", document, probe_import(box, document))
        else:
            event, payload = data.draw(event_payloads(box.routes))
            ascii_only = data.draw(st.booleans())
            record(f"event {event}", payload, probe_event(box.socket, event, payload, ascii_only))
        if counts["examples"] % 250 == 0:
            print(f"  {counts['examples']} examples, {counts['crashes']} crashes", flush=True)

    if args.seed is not None:
        fuzz = seed(args.seed)(fuzz)
    try:
        fuzz()
    finally:
        time.sleep(0.5)  # queued echo completions finish writing
        outside = sorted(tree_outside(box.parent, box.daemon.layout.root) - box.before)
        escaped = escapes(box.parent, Path("/tmp"))
        runner.close()
    if outside or escaped:
        counts["crashes"] += 1
        failures.append(("files", f"written outside var/: {outside} {escaped}"))
    seconds = time.perf_counter() - started
    per_event = {k: v for k, v in sorted(counts.items()) if k.startswith("event ")}
    print()
    print(f"examples run       {counts['examples']}")
    print(f"  random bytes     {counts['random_bytes']}")
    print(f"  random JSON      {counts['random_json']}")
    print(f"  event payloads   {sum(per_event.values())} over {len(per_event)} events")
    print(f"  bounded values   {sum(v for k, v in counts.items() if k.startswith('bounded '))}")
    print(f"  damaged imports  {counts['damaged_import']}")
    print(f"crashes found      {counts['crashes']}")
    print(f"internal errors    {codes.get('internal_error', 0)}  (structured, but worth a look in the log)")
    print(f"seconds            {seconds:.1f}")
    print(f"error codes        {dict(codes.most_common())}")
    for kind, text in failures[:5]:
        print(f"\n[{kind}] {text}")
    summary = {"examples": counts["examples"], "crashes": counts["crashes"],
               "internal_errors": codes.get("internal_error", 0), "seconds": round(seconds, 1),
               "error_codes": dict(codes), "events": len(per_event)}
    print("\n" + json.dumps(summary))
    return 1 if counts["crashes"] else 0


if __name__ == "__main__":
    sys.exit(main())
