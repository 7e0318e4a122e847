"""Benchmark of the daemon foundation against its goals (DESIGN.md section 7), baselines in the same run.

    .venv/bin/python scripts/bench/socket_bench.py [--quick]

Measures, side by side on this machine:
  (a) `system:health` round trip on one connection (5,000 sequential) vs a bare asyncio
      Unix-socket echo server answering a line of the same size;
  (b) throughput with 20 connections spread over several client processes, both with one
      request in flight per connection (request/reply) and pipelined (a window per
      connection), vs the echo server under the same client;
  (c) daemon start, spawn to the first `system:health` reply (median of 5), with the
      default litellm preload and without it, vs a bare `python -c pass`;
  (d) daemon idle RSS after start (litellm not loaded) vs the echo server's RSS, and, for
      information, the RSS right after start and once litellm has loaded in the background;
  (e) wall time of `ksi send system:health`, process start included (median of 20), vs
      `python -c pass`.
Prints a table and writes scripts/bench/results/socket_bench.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import selectors
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
from harness import clean_env, machine, write_results

HEALTH = b'{"event":"system:health","data":{},"correlation_id":"b-1"}\n'

# The reference daemon of DESIGN.md section 7, measured on this machine.
REFERENCE = {"round_trip_ms": 7.4, "throughput_rps": 266, "start_s": 7.4, "idle_rss_mb": 257, "cli_s": 0.46}


# -- the echo server baseline ------------------------------------------------------


class _Echo(asyncio.Protocol):
    """Line in, line out: every complete line is written back as it is."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.buffer = bytearray()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        start = 0
        while (end := self.buffer.find(b"\n", start)) >= 0:
            self.transport.write(bytes(self.buffer[start:end + 1]))  # type: ignore[attr-defined]
            start = end + 1
        if start:
            del self.buffer[:start]


async def _echo_serve(path: str) -> None:
    server = await asyncio.get_running_loop().create_unix_server(_Echo, path=path, backlog=1024)
    async with server:
        await server.serve_forever()


def echo_server_main(path: str) -> None:
    asyncio.run(_echo_serve(path))


# -- small blocking clients ---------------------------------------------------------


def connect(path: Path | str, timeout: float = 5.0) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.connect(str(path))
    return sock


def read_line(sock: socket.socket, buffer: bytearray) -> bytes:
    while (end := buffer.find(b"\n")) < 0:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        buffer += chunk
    line = bytes(buffer[:end])
    del buffer[:end + 1]
    return line


def ask(path: Path | str, line: bytes, timeout: float = 5.0) -> dict[str, Any]:
    with connect(path, timeout) as sock:
        sock.sendall(line)
        return json.loads(read_line(sock, bytearray()))


def wait_for_socket(path: Path, process: subprocess.Popen[bytes] | None, timeout: float = 30.0) -> float:
    """Poll until `path` answers a health request; the moment it did (perf_counter)."""
    deadline = time.perf_counter() + timeout
    while True:
        try:
            reply = ask(path, HEALTH, timeout=timeout)
            if "data" in reply or "correlation_id" in reply:
                return time.perf_counter()
        except (OSError, ValueError):
            pass
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"process exited with {process.returncode}")
        if time.perf_counter() > deadline:
            raise RuntimeError(f"{path} did not answer within {timeout}s")
        time.sleep(0.002)


def _round_trips(sock: socket.socket, line: bytes, count: int) -> list[float]:
    times: list[float] = []
    buffer = bytearray()
    for _ in range(count):
        started = time.perf_counter_ns()
        sock.sendall(line)
        read_line(sock, buffer)
        times.append((time.perf_counter_ns() - started) / 1000)
    return times


def cpu_seconds(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def interleaved_round_trips(targets: dict[str, tuple[Path, bytes, int]], count: int, blocks: int = 10,
                            warmup: int = 500) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Round-trip times (us) of `count` sequential requests per target, one connection each,
    and the CPU time (us) the server process `pid` spent per request.

    The targets take turns in blocks, so that noise from other work on the machine falls on
    all of them alike instead of on whichever happened to run during it."""
    socks = {name: connect(path) for name, (path, _line, _pid) in targets.items()}
    times: dict[str, list[float]] = {name: [] for name in targets}
    cpu = dict.fromkeys(targets, 0.0)
    try:
        for name, sock in socks.items():
            _round_trips(sock, targets[name][1], warmup)
        per_block = max(1, count // blocks)
        for _ in range(blocks):
            for name, sock in socks.items():
                before = cpu_seconds(targets[name][2])
                times[name] += _round_trips(sock, targets[name][1], per_block)
                cpu[name] += cpu_seconds(targets[name][2]) - before
    finally:
        for sock in socks.values():
            sock.close()
    return times, {name: cpu[name] / len(times[name]) * 1e6 for name in targets}


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(fraction * (len(ordered) - 1))))]


# -- throughput: several client processes, a few connections each -------------------


def throughput_worker(path: str, line: bytes, connections: int, window: int, start_at: float,
                      duration: float, results: Any) -> None:
    """Keep `window` requests in flight on each connection; count replies between start and end."""
    selector = selectors.DefaultSelector()
    socks = []
    for _ in range(connections):
        sock = connect(path)
        sock.settimeout(None)
        sock.sendall(line * window)
        selector.register(sock, selectors.EVENT_READ)
        socks.append(sock)
    replies = 0
    counted = 0
    checked = False
    end_at = start_at + duration
    while (now := time.time()) < end_at:
        for key, _mask in selector.select(timeout=0.05):
            sock = key.fileobj
            data = sock.recv(1 << 18)  # type: ignore[union-attr]
            if not data:
                raise ConnectionError("closed")
            if not checked:
                checked = b'"healthy"' in data or b'"event"' in data
            done = data.count(b"\n")
            if done:
                sock.sendall(line * done)  # type: ignore[union-attr]
                replies += done
                if now >= start_at:
                    counted += done
    for sock in socks:
        sock.close()
    results.put({"replies": counted, "ok": checked})


def throughput(path: Path, line: bytes, processes: int, per_process: int, window: int,
               duration: float, warmup: float, watch_pid: int | None = None) -> dict[str, Any]:
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    start_at = time.time() + warmup + 0.3
    workers = [
        ctx.Process(target=throughput_worker,
                    args=(str(path), line, per_process, window, start_at, duration, results))
        for _ in range(processes)
    ]
    for worker in workers:
        worker.start()
    cpu = None
    if watch_pid is not None:
        watched = psutil.Process(watch_pid)
        time.sleep(max(0.0, start_at - time.time()))
        before = watched.cpu_times()
        time.sleep(duration)
        after = watched.cpu_times()
        cpu = ((after.user + after.system) - (before.user + before.system)) / duration
    outcome = [results.get(timeout=duration + warmup + 30) for _ in workers]
    for worker in workers:
        worker.join()
    total = sum(item["replies"] for item in outcome)
    return {
        "requests_per_s": total / duration,
        # what one fully used core of the server would do: robust to other load on the machine
        "requests_per_server_cpu_s": total / (cpu * duration) if cpu else None,
        "connections": processes * per_process,
        "client_processes": processes,
        "in_flight_per_connection": window,
        "all_replies_valid": all(item["ok"] for item in outcome),
        "server_cpu_cores": cpu,
    }


# -- processes ----------------------------------------------------------------------


def spawn_daemon(root: Path, preload: bool) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "ksi_daemon", "--quiet", "--var-dir", str(root / "var"),
         "--socket", str(root / "d.sock")],
        cwd=root, env=clean_env(KSI_LITELLM_PRELOAD="true" if preload else "false"),
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


def stop_daemon(root: Path, process: subprocess.Popen[bytes]) -> None:
    try:
        ask(root / "d.sock", b'{"event":"system:shutdown"}\n')
    except OSError:
        pass
    try:
        process.wait(15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / (1024 * 1024)


def start_times(root: Path, runs: int, preload: bool) -> list[float]:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        process = spawn_daemon(root, preload)
        answered = wait_for_socket(root / "d.sock", process)
        times.append(answered - started)
        stop_daemon(root, process)
    return times


def wall_times(command: list[str], runs: int, cwd: Path, warmup: int = 2) -> list[float]:
    times = []
    env = clean_env()
    for index in range(warmup + runs):
        started = time.perf_counter()
        result = subprocess.run(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        elapsed = time.perf_counter() - started
        if result.returncode != 0:
            raise RuntimeError(f"{command} failed: {result.stderr.decode(errors='replace')}")
        if index >= warmup:
            times.append(elapsed)
    return times


# -- the run -------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    load_before = os.getloadavg()
    root = Path(tempfile.mkdtemp(prefix="ksi-bench-", dir="/tmp"))
    echo_path = root / "echo.sock"
    echo = subprocess.Popen([sys.executable, __file__, "--echo-server", str(echo_path)], cwd=root,
                            env=clean_env(), stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    daemon = None
    report: dict[str, Any] = {}
    try:
        wait_for_socket(echo_path, echo)
        print("daemon (litellm preload off) ...", file=sys.stderr)
        spawned = time.perf_counter()
        daemon = spawn_daemon(root, preload=False)
        wait_for_socket(root / "d.sock", daemon)
        first_reply = time.perf_counter() - spawned
        sock_path = root / "d.sock"

        # (d) idle RSS, litellm not loaded
        time.sleep(1.0)
        daemon_rss = rss_mb(daemon.pid)
        echo_rss = rss_mb(echo.pid)
        health = ask(sock_path, HEALTH)["data"]

        # (a) latency on one connection, same-size lines for the echo server
        reply_size = len(json.dumps(ask(sock_path, HEALTH), separators=(",", ":"))) + 1
        echo_line = b'{"event":"echo","pad":"' + b"x" * max(0, reply_size - 26) + b'"}\n'
        print("round trips ...", file=sys.stderr)
        rts, cpu_per_request = interleaved_round_trips(
            {"echo": (echo_path, echo_line, echo.pid), "daemon": (sock_path, HEALTH, daemon.pid)},
            args.round_trips)
        echo_rt, daemon_rt = rts["echo"], rts["daemon"]

        # (b) throughput, 20 connections
        print("throughput ...", file=sys.stderr)
        procs, per = args.client_processes, args.connections // args.client_processes
        tp = {}
        for label, window in (("request_reply", 1), ("pipelined", args.window)):
            tp[label] = {
                "daemon": throughput(sock_path, HEALTH, procs, per, window, args.duration, 0.5, daemon.pid),
                "echo": throughput(echo_path, echo_line, procs, per, window, args.duration, 0.5, echo.pid),
            }
        health_after = ask(sock_path, HEALTH)["data"]

        # (e) `ksi send system:health`, process start included
        print("cli ...", file=sys.stderr)
        ksi = Path(sys.executable).parent / "ksi"
        cli = wall_times([str(ksi), "send", "--socket", str(sock_path), "system:health"], args.cli_runs, root)
        bare_python = wall_times([sys.executable, "-c", "pass"], args.cli_runs, root)
        stop_daemon(root, daemon)
        daemon = None

        # (c) start until the socket answers, with and without the litellm preload
        print("start times ...", file=sys.stderr)
        start_no_preload = start_times(root, args.starts, preload=False)
        start_preload = start_times(root, args.starts, preload=True)

        # (d') RSS with the default preload: right after start, and once litellm has loaded
        spawned = time.perf_counter()
        daemon = spawn_daemon(root, preload=True)
        wait_for_socket(sock_path, daemon)
        rss_at_start = rss_mb(daemon.pid)
        loaded_after = None
        deadline = time.perf_counter() + 60
        while time.perf_counter() < deadline:
            if ask(sock_path, HEALTH)["data"].get("litellm_loaded"):
                loaded_after = time.perf_counter() - spawned
                break
            time.sleep(0.1)
        rss_loaded = rss_mb(daemon.pid)
        stop_daemon(root, daemon)
        daemon = None

        report = {
            "machine": machine(load_average_before=load_before, load_average_after=os.getloadavg()),
            "round_trip": {
                "count": args.round_trips,
                "daemon_median_us": statistics.median(daemon_rt),
                "daemon_p99_us": percentile(daemon_rt, 0.99),
                "echo_median_us": statistics.median(echo_rt),
                "echo_p99_us": percentile(echo_rt, 0.99),
                "daemon_cpu_us_per_request": cpu_per_request["daemon"],
                "echo_cpu_us_per_request": cpu_per_request["echo"],
                "line_bytes": {"request": len(HEALTH), "reply": reply_size, "echo": len(echo_line)},
            },
            "throughput": tp,
            "start": {
                "preload_on_s": start_preload,
                "preload_off_s": start_no_preload,
                "preload_on_median_s": statistics.median(start_preload),
                "preload_off_median_s": statistics.median(start_no_preload),
                "first_start_s": first_reply,
                "bare_python_median_s": statistics.median(bare_python),
            },
            "rss_mb": {
                "idle_preload_off": daemon_rss,
                "preload_on_at_first_reply": rss_at_start,
                "preload_on_after_litellm_loaded": rss_loaded,
                "litellm_loaded_after_s": loaded_after,
                "echo_server": echo_rss,
            },
            "cli": {
                "ksi_send_health_median_s": statistics.median(cli),
                "ksi_send_health_p90_s": percentile(cli, 0.9),
                "bare_python_median_s": statistics.median(bare_python),
                "runs": args.cli_runs,
            },
            "health": {"before": health, "after_load": health_after},
            "reference_daemon": REFERENCE,
        }
        report["goals"] = goals(report)
        return report
    finally:
        if daemon is not None:
            stop_daemon(root, daemon)
        echo.terminate()
        echo.wait()
        shutil.rmtree(root, ignore_errors=True)


def goals(report: dict[str, Any]) -> list[dict[str, Any]]:
    rt = report["round_trip"]
    tp = report["throughput"]
    rr, pl = tp["request_reply"], tp["pipelined"]
    start = report["start"]
    rss = report["rss_mb"]
    cli = report["cli"]
    ratio = rt["daemon_median_us"] / rt["echo_median_us"]
    return [
        {"what": "system:health round trip, 1 connection (median)", "goal": "<= 1.5x echo",
         "measured": f"{rt['daemon_median_us']:.0f} us ({ratio:.2f}x), p99 {rt['daemon_p99_us']:.0f} us, "
                     f"CPU {rt['daemon_cpu_us_per_request']:.0f} us/req",
         "baseline": f"echo {rt['echo_median_us']:.0f} us, p99 {rt['echo_p99_us']:.0f} us, "
                     f"CPU {rt['echo_cpu_us_per_request']:.0f} us/req",
         "pass": ratio <= 1.5},
        {"what": "throughput, 20 conns, 1 in flight each", "goal": ">= 10,000 req/s",
         "measured": f"{rr['daemon']['requests_per_s']:,.0f} req/s (daemon CPU {rr['daemon']['server_cpu_cores']:.2f} cores; "
                     f"{rr['daemon']['requests_per_server_cpu_s']:,.0f} per daemon CPU-second)",
         "baseline": f"echo {rr['echo']['requests_per_s']:,.0f} req/s",
         "pass": rr["daemon"]["requests_per_s"] >= 10_000 and rr["daemon"]["all_replies_valid"]},
        {"what": f"throughput, 20 conns, pipelined x{pl['daemon']['in_flight_per_connection']}",
         "goal": ">= 10,000 req/s",
         "measured": f"{pl['daemon']['requests_per_s']:,.0f} req/s (daemon CPU {pl['daemon']['server_cpu_cores']:.2f} cores; "
                     f"{pl['daemon']['requests_per_server_cpu_s']:,.0f} per daemon CPU-second)",
         "baseline": f"echo {pl['echo']['requests_per_s']:,.0f} req/s",
         "pass": pl["daemon"]["requests_per_s"] >= 10_000 and pl["daemon"]["all_replies_valid"]},
        {"what": "daemon start until socket answers (median of 5, preload on)", "goal": "< 0.5 s",
         "measured": f"{start['preload_on_median_s']:.3f} s (preload off {start['preload_off_median_s']:.3f} s)",
         "baseline": f"python -c pass {start['bare_python_median_s']:.3f} s",
         "pass": start["preload_on_median_s"] < 0.5},
        {"what": "daemon idle RSS, litellm not loaded", "goal": "< 60 MB",
         "measured": f"{rss['idle_preload_off']:.1f} MB (preload on: {rss['preload_on_at_first_reply']:.1f} MB at first reply, "
                     f"{rss['preload_on_after_litellm_loaded']:.1f} MB loaded)",
         "baseline": f"echo server {rss['echo_server']:.1f} MB",
         "pass": rss["idle_preload_off"] < 60},
        {"what": "ksi send system:health, process start included (median)", "goal": "< 0.15 s",
         "measured": f"{cli['ksi_send_health_median_s']:.3f} s (p90 {cli['ksi_send_health_p90_s']:.3f} s)",
         "baseline": f"python -c pass {cli['bare_python_median_s']:.3f} s",
         "pass": cli["ksi_send_health_median_s"] < 0.15},
    ]


def print_table(rows: list[dict[str, Any]]) -> None:
    headers = ("what", "goal", "measured", "baseline", "result")
    cells = [[row["what"], row["goal"], row["measured"], row["baseline"], "PASS" if row["pass"] else "FAIL"]
             for row in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    line = " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    print(line)
    print("-+-".join("-" * w for w in widths))
    for cell in cells:
        print(" | ".join(c.ljust(w) for c, w in zip(cell, widths, strict=True)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--echo-server", help=argparse.SUPPRESS)
    parser.add_argument("--round-trips", type=int, default=5000)
    parser.add_argument("--connections", type=int, default=20)
    parser.add_argument("--client-processes", type=int, default=4)
    parser.add_argument("--window", type=int, default=16, help="requests in flight per connection when pipelined")
    parser.add_argument("--duration", type=float, default=3.0, help="seconds of each throughput run")
    parser.add_argument("--starts", type=int, default=5)
    parser.add_argument("--cli-runs", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="fewer samples, for a smoke run")
    args = parser.parse_args()
    if args.echo_server:
        echo_server_main(args.echo_server)
        return 0
    if args.quick:
        args.round_trips, args.duration, args.starts, args.cli_runs = 1000, 1.0, 2, 5
    report = run(args)
    print_table(report["goals"])
    machine = report["machine"]
    print(f"\n{machine['cpus']} CPUs, Python {machine['python']}; load average before "
          f"{machine['load_average_before'][0]:.2f}, after {machine['load_average_after'][0]:.2f} "
          "(other work on the machine inflates every wall-clock number above)")
    write_results("socket_bench", report)
    return 0 if all(row["pass"] for row in report["goals"]) else 1


if __name__ == "__main__":
    sys.exit(main())
