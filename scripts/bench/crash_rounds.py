"""Crash safety, longer than the test: SIGKILL a subprocess daemon at random moments under load,
restart it, and count what was lost (the harness of tests/test_crash.py).

    .venv/bin/python scripts/bench/crash_rounds.py [--rounds 10] [--total 1000] [--conversations 20] [--seed N]

Each round starts the daemon (litellm preloaded), warms it with one completion, pipelines
completions over the conversations from a stub OpenAI server that answers after 5-80 ms, and
kills the daemon 0.05-1.0 s later; the files are checked with the daemon dead, and after the
restart every request that was open at the kill must be reported failed with daemon_restart (and
not be indexed) or done (and be indexed). A last life finishes the remaining completions and one
more per conversation. "lost" counts acknowledged exchanges (result delivered to the client) that
are missing from their index or response file: it must be 0.
Prints a table and writes scripts/bench/results/crash_rounds.json.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
from pathlib import Path

from harness import write_results

from tests.test_crash import crash_rounds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--total", type=int, default=1000, help="completions sent under fire")
    parser.add_argument("--conversations", type=int, default=20)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kcr-", dir="/tmp"))
    failed = False
    try:
        outcome = asyncio.run(crash_rounds(root, rounds=args.rounds, total=args.total,
                                           conversations=args.conversations, seed=args.seed,
                                           log=lambda line: print("  " + line, flush=True)))
    except AssertionError as error:  # a rule broken mid-run (half-indexed, unreadable file, ...)
        print(f"FAILED: {error}")
        outcome = {"error": str(error)}
        failed = True
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if not failed:
        rows = [
            ("rounds survived (SIGKILL + restart)", outcome["rounds_survived"]),
            ("completions acknowledged", outcome["acked"]),
            ("  results delivered", outcome["delivered"]),
            ("  done, indexed just before a kill", outcome["recovered_done"]),
            ("  failed with daemon_restart", outcome["failed_daemon_restart"]),
            ("  other failures", len(outcome["failed_other"])),
            ("exchanges indexed at the end", outcome["indexed"]),
            ("indexed but not done / done but not indexed",
             f"{len(outcome['indexed_not_done'])} / {len(outcome['done_not_indexed'])}"),
            ("acknowledged exchanges lost (must be 0)", len(outcome["lost"])),
            ("seconds", outcome["seconds"]),
            ("seed", outcome["seed"]),
        ]
        width = max(len(name) for name, _ in rows)
        print()
        for name, value in rows:
            print(f"{name.ljust(width)}  {value}")
        failed = bool(outcome["lost"] or outcome["indexed_not_done"] or outcome["done_not_indexed"]
                      or outcome["failed_but_indexed"] or outcome["open"] or outcome["failed_other"])
    write_results("crash_rounds", {"args": vars(args), **outcome, "ok": not failed})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
