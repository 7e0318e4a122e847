"""The first `ksi ask` after a daemon start, echo model: it must not wait for litellm's import.

    .venv/bin/python scripts/bench/first_ask.py [--rounds 7]

Each round starts a daemon with `ksi daemon start` on a fresh var dir (litellm then loads in the
background, which takes seconds), and at once runs, in the round's rotated order:
  - `ksi ask --model echo/bench "..."`, the first completion of that daemon: wall time, process
    start included. Goal: under 0.3 s (median).
  - `ksi send system:health`, the baseline: the same CLI process, a request with no completion.
then stops the daemon. For information, each round also times a second `ksi ask` once litellm is
loaded (the daemon log says when). Prints a table (medians, and the ratio of the first ask to the
baseline) and writes scripts/bench/results/first_ask.json.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import clean_env, machine, rotated, write_results

GOAL_S = 0.3
LOADED_WAIT_S = 60.0


def timed(command: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()[-500:]}")
    return elapsed


def litellm_loaded(var_dir: Path) -> bool:
    log = var_dir / "logs" / "daemon" / "daemon.log"
    return log.exists() and "litellm_loaded" in log.read_text(errors="replace")


def one_round(round_no: int, env: dict[str, str]) -> dict[str, float]:
    root = Path(tempfile.mkdtemp(prefix="ksi-first-", dir="/tmp"))
    where = ["--var-dir", str(root / "var"), "--socket", str(root / "d.sock")]
    ksi = [sys.executable, "-m", "ksi_cli"]
    started = subprocess.run([*ksi, "daemon", "start", *where], env=env, capture_output=True, text=True, timeout=60)
    if started.returncode != 0:
        raise RuntimeError(f"ksi daemon start failed: {started.stderr.strip()}")
    runs = {
        "first_ask_s": [*ksi, "ask", "--model", "echo/bench", f"round {round_no}: the first question", *where],
        "health_s": [*ksi, "send", "--socket", str(root / "d.sock"), "system:health"],
    }
    try:
        measured = {name: timed(runs[name], env) for name in rotated(list(runs), round_no)}
        measured["litellm_loaded_after_first_ask"] = float(litellm_loaded(root / "var"))
        deadline = time.monotonic() + LOADED_WAIT_S
        while not litellm_loaded(root / "var") and time.monotonic() < deadline:
            time.sleep(0.1)
        measured["ask_with_litellm_loaded_s"] = timed(
            [*ksi, "ask", "--model", "echo/bench", "-c", "and once litellm is loaded", *where], env)
    finally:
        subprocess.run([*ksi, "daemon", "stop", *where], env=env, capture_output=True, timeout=120)
        shutil.rmtree(root, ignore_errors=True)
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    env = clean_env()
    rounds = []
    for round_no in range(args.rounds):
        rounds.append(one_round(round_no, env))
        print(f"round {round_no + 1}/{args.rounds}: " + ", ".join(f"{k} {v:.3f}" for k, v in rounds[-1].items()),
              flush=True)
    median = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    ratio = median["first_ask_s"] / median["health_s"]
    print(f"\n{'what':<52} {'median':>9}")
    print(f"{'ksi send system:health right after the start (baseline)':<52} {median['health_s']:>8.3f}s")
    print(f"{'first ksi ask, echo model, right after the start':<52} {median['first_ask_s']:>8.3f}s")
    print(f"{'ksi ask once litellm is loaded (information)':<52} {median['ask_with_litellm_loaded_s']:>8.3f}s")
    print(f"\nfirst ask / health: {ratio:.2f}x; goal: first ask under {GOAL_S} s: "
          f"{'met' if median['first_ask_s'] < GOAL_S else 'MISSED'}; litellm was still loading at the first "
          f"ask in {sum(1 for r in rounds if not r['litellm_loaded_after_first_ask'])} of {len(rounds)} rounds")
    write_results("first_ask", {"machine": machine(), "rounds": rounds, "median": median, "ratio": ratio,
                                "goal_s": GOAL_S, "met": median["first_ask_s"] < GOAL_S})


if __name__ == "__main__":
    main()
