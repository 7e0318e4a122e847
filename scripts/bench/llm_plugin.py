"""What the `llm` plugin costs: wall time of real `llm` commands with the plugin, against `llm`
with no plugins loaded (its own start-up) and `ksi ask`, in the same run, rounds interleaved.

    .venv/bin/python scripts/bench/llm_plugin.py [--rounds 7]

A real daemon (subprocess) on a temporary var dir answers with the built-in echo model; `llm`'s
user directory is temporary too. Writes scripts/bench/results/llm_plugin.json.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import rotated, write_results

BIN = Path(sys.executable).parent


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(command: list[str], env: dict[str, str], cwd: Path) -> tuple[float, float]:
    """Wall time and CPU time of one command (CPU is steadier on a busy machine)."""
    cpu, start = children_cpu(), time.perf_counter()
    done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=120)
    elapsed, cpu = time.perf_counter() - start, children_cpu() - cpu
    if done.returncode != 0 and "daemon_unreachable" not in done.stderr:
        raise SystemExit(f"{' '.join(command)} failed: {done.stderr}")
    return elapsed, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="ksi-llm-bench-", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KSI_", "LLM_", "OPENAI_"))}
    env.update(KSI_VAR_DIR=str(root / "var"), LLM_USER_PATH=str(root / "llm"), OPENAI_API_KEY="sk-bench")
    bare = {**env, "LLM_LOAD_PLUGINS": ""}  # llm itself, no plugin loaded
    down = {**env, "KSI_SOCKET_PATH": str(root / "nobody.sock")}
    llm, ksi = str(BIN / "llm"), str(BIN / "ksi")
    try:
        subprocess.run([ksi, "daemon", "start"], env=env, cwd=root, check=True, capture_output=True, timeout=60)
        subprocess.run([llm, "-m", "ksi/echo/demo", "warm up"], env=env, cwd=root, check=True,
                       capture_output=True, timeout=120)
        cases = {
            "llm models, no plugins (baseline: llm's own start)": ([llm, "models"], bare),
            "llm models, plugin, daemon up": ([llm, "models"], env),
            "llm models, plugin, daemon down (cache)": ([llm, "models"], down),
            "ksi ask --model echo/demo (baseline: KSI's own CLI)": ([ksi, "ask", "--model", "echo/demo", "hi"], env),
            "llm -m ksi/echo/demo (new conversation)": ([llm, "-m", "ksi/echo/demo", "hi"], env),
            "llm -c (continue it)": ([llm, "-c", "again"], env),
        }
        samples: dict[str, list[float]] = {name: [] for name in cases}
        cpu: dict[str, list[float]] = {name: [] for name in cases}
        for round_no in range(args.rounds):
            for name in rotated(list(cases), round_no):
                command, case_env = cases[name]
                wall, used = timed(command, case_env, root)
                samples[name].append(wall)
                cpu[name].append(used)
    finally:
        subprocess.run([ksi, "daemon", "stop"], env=env, cwd=root, capture_output=True, timeout=60)
        shutil.rmtree(root, ignore_errors=True)

    medians = {name: statistics.median(values) for name, values in samples.items()}
    cpu_medians = {name: statistics.median(values) for name, values in cpu.items()}
    base_name = "llm models, no plugins (baseline: llm's own start)"
    base, base_cpu = medians[base_name], cpu_medians[base_name]
    print(f"{'command':58} {'wall s':>7} {'vs base':>8} {'CPU s':>7} {'vs base':>8}")
    for name, value in medians.items():
        used = cpu_medians[name]
        print(f"{name:58} {value:7.3f} {value - base:+8.3f} {used:7.3f} {used - base_cpu:+8.3f}")
    write_results("llm_plugin", {"rounds": args.rounds, "median_seconds": medians, "median_cpu_seconds": cpu_medians,
                                 "samples": samples, "cpu_samples": cpu, "load_average": os.getloadavg()})


if __name__ == "__main__":
    main()
