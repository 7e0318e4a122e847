"""`ksi ask` on a terminal: how fast a provider's first chunk reaches the screen, and start-up.

    .venv/bin/python scripts/bench/ask_stream.py [--rounds 15]

Measures, side by side in one run on this machine:
  (a) first chunk to terminal: a local OpenAI-compatible streaming server (its own process)
      sends the first chunk, notes the time (CLOCK_MONOTONIC, shared by every process of the
      machine), then holds the second chunk back for DELAY seconds; `ksi ask` runs on a
      pseudo-terminal against a real daemon subprocess, and the time its first chunk appears on
      the terminal is noted by the reader of the terminal. Goal: under 50 ms (median).
      Baseline: the official `openai` SDK streaming straight from the same server to the same
      kind of terminal (no daemon, no CLI).
  (b) `ksi ask` start-up: from the process's spawn to its `completion:async` request arriving
      on the socket (the bench listens there itself, so no daemon work is counted), median.
      Goal: under 0.15 s. Baselines: the same for `ksi send system:health`, and for a bare
      `python -c` client that connects and sends one line. For information, the whole wall
      time of `ksi ask --model echo/bench hi` against the real daemon (its completion, with
      fsync, included).
Prints a table and writes scripts/bench/results/ask_stream.json.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import clean_env, stub_models, write_results

DELAY = 0.5  # seconds the second chunk is held back: what arrives before it is the first chunk
FIRST = "alpha"

STUB = r'''
import asyncio, json, sys, time
from aiohttp import web

DELAY = float(sys.argv[1])

def chunk(text, finish=None):
    delta = {"content": text} if text else {}
    body = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0, "model": "stub",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if finish:
        body["usage"] = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    return f"data: {json.dumps(body)}\n\n".encode()

async def chat(request):
    await request.json()
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(chunk("alpha "))
    print(time.monotonic(), flush=True)  # the moment the first chunk left the provider
    await asyncio.sleep(DELAY)
    await response.write(chunk("omega"))
    await response.write(chunk("", "stop"))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response

async def main():
    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    print(site._server.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
'''

BASELINE = r'''
import sys
from openai import OpenAI
client = OpenAI(base_url=sys.argv[1], api_key="no-key", max_retries=0)
for event in client.chat.completions.create(model="stub", messages=[{"role": "user", "content": "hi"}], stream=True):
    if event.choices and event.choices[0].delta.content:
        sys.stdout.write(event.choices[0].delta.content)
        sys.stdout.flush()
sys.stdout.write("\n")
'''


def on_terminal(command: list[str], cwd: Path, env: dict[str, str], stub: subprocess.Popen[str]) -> float:
    """Run `command` with stdout on a pseudo-terminal; seconds from the stub's first chunk to its display."""
    master, slave = os.openpty()
    process = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=slave,
                               stderr=subprocess.DEVNULL)
    os.close(slave)
    seen_at = None
    text = b""
    try:
        while seen_at is None:
            ready, _, _ = select.select([master], [], [], 30)
            if not ready:
                raise RuntimeError(f"no output from {command[:4]}")
            data = os.read(master, 4096)
            now = time.monotonic()
            text += data
            if FIRST.encode() in text:
                seen_at = now
                if b"omega" in text:
                    raise RuntimeError("the second chunk came with the first: the measure would be wrong")
        while True:  # drain until the process exits
            ready, _, _ = select.select([master], [], [], 30)
            if not ready:
                break
            try:
                if not os.read(master, 4096):
                    break
            except OSError:
                break
    finally:
        process.wait(30)
        os.close(master)
    assert stub.stdout is not None
    sent_at = float(stub.stdout.readline())
    return seen_at - sent_at


BARE_CLIENT = r'''
import socket, sys
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])
s.sendall(b'{"event": "completion:async", "data": {"prompt": "hi"}, "correlation_id": "x"}\n'); s.recv(65536)
'''


def time_to_request(command: list[str], socket_path: Path, event: str, cwd: Path, env: dict[str, str]) -> float:
    """Seconds from spawning `command` until its `event` request arrives on `socket_path` (served here)."""
    import socket as sockets

    server = sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM)
    socket_path.unlink(missing_ok=True)
    server.bind(str(socket_path))
    server.listen(4)
    started = time.monotonic()
    process = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    arrived = None
    try:
        server.settimeout(30)
        while arrived is None:
            connection, _ = server.accept()
            with connection:
                buffer = b""
                while arrived is None:
                    data = connection.recv(65536)
                    if not data:
                        break
                    buffer += data
                    while b"\n" in buffer:
                        line, buffer = buffer.split(b"\n", 1)
                        frame = json.loads(line)
                        if frame["event"] == event:
                            arrived = time.monotonic()
                            reply = {"event": event, "correlation_id": frame.get("correlation_id"),
                                     "error": {"code": "shutting_down", "message": "bench", "details": {}}}
                        else:  # monitor:subscribe before the question: say yes
                            reply = {"event": frame["event"], "correlation_id": frame.get("correlation_id"),
                                     "data": {"subscription_id": "sub-bench", "patterns": []}}
                        connection.sendall(json.dumps(reply).encode() + b"\n")
    finally:
        process.wait(30)
        server.close()
        socket_path.unlink(missing_ok=True)
    return arrived - started


def wall(command: list[str], cwd: Path, env: dict[str, str], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        subprocess.run(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=True)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ksi-bench-", dir="/tmp"))
    base_env = clean_env(OPENAI_API_KEY="sk-bench")
    stub = subprocess.Popen([sys.executable, "-c", STUB, str(DELAY)], stdout=subprocess.PIPE, text=True,
                            env=base_env)
    daemon = None
    try:
        assert stub.stdout is not None
        api_base = f"http://127.0.0.1:{int(stub.stdout.readline())}/v1"
        env = {**base_env, "KSI_MODELS": stub_models(api_base)}
        where = ["--var-dir", str(root / "var"), "--socket", str(root / "d.sock")]
        daemon = subprocess.Popen([sys.executable, "-m", "ksi_daemon", "--quiet", *where], cwd=root, env=env,
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        ksi = [sys.executable, "-m", "ksi_cli"]
        ask = [*ksi, "ask", "--model", "openai/stub-model", "hi", *where]
        deadline = time.monotonic() + 60
        while subprocess.run([*ksi, "send", "--socket", str(root / "d.sock"), "system:health"], cwd=root, env=env,
                             capture_output=True).returncode != 0:
            if time.monotonic() > deadline:
                raise RuntimeError("the daemon did not start")
            time.sleep(0.1)
        on_terminal(ask, root, env, stub)  # warm: litellm loaded, connections made
        on_terminal([sys.executable, "-c", BASELINE, api_base], root, env, stub)
        ksi_ms, base_ms = [], []
        for _ in range(args.rounds):
            ksi_ms.append(on_terminal(ask, root, env, stub) * 1000)
            base_ms.append(on_terminal([sys.executable, "-c", BASELINE, api_base], root, env, stub) * 1000)
        startup_rounds = max(args.rounds, 10)
        echo_ask = wall([*ksi, "ask", "--model", "echo/bench", "hi", *where], root, env, startup_rounds)
        fake = root / "f.sock"
        ask_start, send_start, bare_start = [], [], []
        for _ in range(startup_rounds):
            ask_start.append(time_to_request([*ksi, "ask", "hi", "--var-dir", str(root / "fake"), "--socket",
                                              str(fake)], fake, "completion:async", root, env))
            send_start.append(time_to_request([*ksi, "send", "--socket", str(fake), "system:health"], fake,
                                              "system:health", root, env))
            bare_start.append(time_to_request([sys.executable, "-c", BARE_CLIENT, str(fake)], fake,
                                              "completion:async", root, env))
    finally:
        if daemon is not None:
            daemon.terminate()
            daemon.wait(30)
        stub.terminate()
        stub.wait(30)
        shutil.rmtree(root, ignore_errors=True)

    report: dict[str, Any] = {
        "first_chunk_to_terminal_ms": {"ksi_ask_median": round(statistics.median(ksi_ms), 2),
                                       "ksi_ask_max": round(max(ksi_ms), 2),
                                       "openai_sdk_direct_median": round(statistics.median(base_ms), 2),
                                       "goal_ms": 50, "rounds": args.rounds, "second_chunk_delay_s": DELAY},
        "startup_s": {"ksi_ask": round(statistics.median(ask_start), 4),
                      "ksi_send_health": round(statistics.median(send_start), 4),
                      "bare_python_client": round(statistics.median(bare_start), 4),
                      "ksi_ask_echo_whole_run": round(echo_ask, 4), "goal_s": 0.15, "rounds": startup_rounds},
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
    }
    first, startup = report["first_chunk_to_terminal_ms"], report["startup_s"]
    rows = [
        ("first chunk -> terminal, ksi ask (median)", f"{first['ksi_ask_median']:.1f} ms", "< 50 ms",
         "ok" if first["ksi_ask_median"] < 50 else "MISSED"),
        ("first chunk -> terminal, ksi ask (max)", f"{first['ksi_ask_max']:.1f} ms", "", ""),
        ("first chunk -> terminal, openai SDK direct", f"{first['openai_sdk_direct_median']:.1f} ms", "baseline", ""),
        ("ksi ask start-up, spawn to request sent", f"{startup['ksi_ask']:.3f} s", "< 0.15 s",
         "ok" if startup["ksi_ask"] < 0.15 else "MISSED"),
        ("ksi send system:health, spawn to request sent", f"{startup['ksi_send_health']:.3f} s", "baseline", ""),
        ("bare python socket client, spawn to request", f"{startup['bare_python_client']:.3f} s", "baseline", ""),
        ("ksi ask echo/bench, whole run (info)", f"{startup['ksi_ask_echo_whole_run']:.3f} s", "", ""),
    ]
    width = max(len(row[0]) for row in rows)
    for name, value, goal, verdict in rows:
        print(f"{name.ljust(width)}  {value:>10}  {goal:>9}  {verdict}")
    write_results("ask_stream", report)


if __name__ == "__main__":
    main()
