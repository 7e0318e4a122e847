"""What the MCP layer adds to one turn (issue goal: under 5 ms).

    .venv/bin/python scripts/bench/mcp_overhead.py [-n 40] [--repeats 5] [--asks 10]

Separate processes: the local OpenAI-compatible stub (tests/stub_openai.py, answers at once)
and a real `python -m ksi_daemon` with its HTTP front on, routing `openai/stub*` to the stub.
One turn (a new conversation, one prompt) is timed from the client's first byte to the
answer, four ways, in interleaved rounds (order rotated) so machine noise falls on all alike:

  socket      the baseline: the events `ksi ask` sends (completion:async, completion:wait)
              on one open KsiClient connection, without its process start;
  mcp-stdio   the official `mcp` client's `tools/call chat` to a `ksi mcp` process;
  mcp-http    the same call over streamable HTTP to /mcp on the daemon's HTTP front;
  ksi-ask     `ksi ask --json` as a new process per turn (what a shell user pays).

The MCP overhead is the median over rounds of (median mcp turn - median socket turn) of that
round; the goal is under 5 ms. Wall time on a shared, loaded machine includes waiting for a CPU
at each process hop (stdio has one hop more than the socket), so the CPU the MCP layer spends per
turn is measured too (psutil): the `ksi mcp` process's, and the daemon's extra CPU for an HTTP
MCP turn over a socket turn; and the client's own CPU per turn (the official MCP client's vs
KsiClient's), which is on the path but not KSI's. Also measured: the size of the tool list in tokens (cl100k,
the tokenizer litellm counts OpenAI models with; goal under 2,000).

Prints a table and writes scripts/bench/results/mcp_overhead.json.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from harness import Daemon, StubProcess, machine, rotated, serve_stub, stub_env, write_results

GOAL_MS = 5.0
TOKEN_GOAL = 2000
TOKEN = "bench-token-0123456789"


def tool_list_tokens() -> int:
    import tiktoken

    from ksi_mcp.schemas import TOOLS

    spec = importlib.util.find_spec("litellm")  # its bundled tokenizer files, without importing it
    assert spec is not None and spec.submodule_search_locations
    os.environ.setdefault("TIKTOKEN_CACHE_DIR",
                          str(Path(spec.submodule_search_locations[0]) / "litellm_core_utils" / "tokenizers"))
    return len(tiktoken.get_encoding("cl100k_base").encode(json.dumps(TOOLS)))


Turn = Callable[[int], Awaitable[None]]


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    import httpx2
    from mcp import Client, StdioServerParameters
    from mcp.client.stdio import stdio_client
    from mcp.client.streamable_http import streamable_http_client

    from ksi_common.client import KsiClient

    root = Path(tempfile.mkdtemp(prefix="ksi-mcpb-", dir="/tmp"))
    stub = StubProcess(__file__)
    daemon: Daemon | None = None
    try:
        daemon = Daemon(stub.api_base, root, {"KSI_HTTP_TOKEN": TOKEN}, args=("--http", "127.0.0.1:0"))
        await daemon.connect()
        health = await daemon.client.request("system:health")
        where = ["--var-dir", str(daemon.var_dir), "--socket", str(daemon.socket)]

        async with AsyncExitStack() as stack:
            socket = await stack.enter_async_context(KsiClient(daemon.socket))
            stdio = await stack.enter_async_context(Client(stdio_client(StdioServerParameters(
                command=sys.executable, args=["-m", "ksi_cli", "mcp", *where], env=stub_env(), cwd=str(root)))))
            http_client = await stack.enter_async_context(
                httpx2.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60))
            http = await stack.enter_async_context(
                Client(streamable_http_client(f"{health['http']}/mcp", http_client=http_client)))

            async def socket_turn(i: int) -> None:
                ack = await socket.request("completion:async", {"prompt": f"question {i}"})
                result = await socket.request("completion:wait", {"request_id": ack["request_id"], "timeout": 60})
                assert "content" in result

            def mcp_turn(client: Any) -> Turn:
                async def turn(i: int) -> None:
                    result = await client.call_tool("chat", {"prompt": f"question {i}"})
                    assert not result.is_error, result.content

                return turn

            async def ask_turn(i: int) -> None:
                process = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "ksi_cli", "ask", *where, "--json", f"question {i}",
                    env=stub_env(), cwd=root, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
                out, err = await process.communicate()
                assert process.returncode == 0, err.decode()
                assert "content" in json.loads(out)

            ways: dict[str, tuple[Turn, int]] = {
                "socket": (socket_turn, args.n), "mcp-stdio": (mcp_turn(stdio), args.n),
                "mcp-http": (mcp_turn(http), args.n), "ksi-ask": (ask_turn, args.asks),
            }
            for turn, _count in ways.values():  # warm-up: litellm's first call, the clients' set-up
                for i in range(3):
                    await turn(-1 - i)
            import psutil

            mcp_process = next(p for p in psutil.Process().children(recursive=True)
                               if "mcp" in p.cmdline() and "ksi_cli" in p.cmdline())
            daemon_process = daemon.ps

            def cpu_ms(process: Any) -> float:
                times = process.cpu_times()
                return (times.user + times.system) * 1000

            rounds: dict[str, list[float]] = {name: [] for name in ways}
            cpu: dict[str, list[float]] = {"ksi mcp process": [], "daemon, socket turn": [],
                                            "daemon, mcp-http turn": [],
                                            **{f"client, {name} turn": [] for name in ("socket", "mcp-stdio",
                                                                                      "mcp-http")}}
            counter = 0
            for r in range(args.repeats):
                for name in rotated(list(ways), r):
                    turn, count = ways[name]
                    times = []
                    mcp_cpu, daemon_cpu = cpu_ms(mcp_process), cpu_ms(daemon_process)
                    client_cpu = time.process_time()
                    for _ in range(count):
                        counter += 1
                        start = time.perf_counter()
                        await turn(counter)
                        times.append((time.perf_counter() - start) * 1000)
                    rounds[name].append(statistics.median(times))
                    if name != "ksi-ask":  # the client's own CPU: the official MCP client's, or KsiClient's
                        cpu[f"client, {name} turn"].append((time.process_time() - client_cpu) * 1000 / count)
                    if name == "mcp-stdio":
                        cpu["ksi mcp process"].append((cpu_ms(mcp_process) - mcp_cpu) / count)
                    elif name in ("socket", "mcp-http"):
                        cpu[f"daemon, {name} turn"].append((cpu_ms(daemon_process) - daemon_cpu) / count)
    finally:
        if daemon is not None:
            await daemon.stop()
        stub.stop()
        shutil.rmtree(root, ignore_errors=True)

    overhead = {name: statistics.median(m - s for m, s in zip(rounds[name], rounds["socket"], strict=True))
                for name in ("mcp-stdio", "mcp-http", "ksi-ask")}
    return {
        "turn_ms": {name: statistics.median(values) for name, values in rounds.items()},
        "rounds_ms": rounds,
        "overhead_vs_socket_ms": overhead,
        "cpu_ms_per_turn": {name: statistics.median(values) for name, values in cpu.items()},
        "goal_ms": GOAL_MS,
        "tool_list_tokens": tool_list_tokens(),
        "token_goal": TOKEN_GOAL,
        "n": args.n, "asks": args.asks, "repeats": args.repeats,
        "machine": machine(),
    }


def show(report: dict[str, Any]) -> None:
    print(f"one turn against the instant stub, median of {report['repeats']} interleaved rounds")
    print(f"{'way':<11} {'turn ms':>9} {'vs socket ms':>13}")
    for name, ms in report["turn_ms"].items():
        extra = report["overhead_vs_socket_ms"].get(name)
        print(f"{name:<11} {ms:>9.2f} {'' if extra is None else f'{extra:+.2f}':>13}")
    print("CPU ms per turn: " + ", ".join(f"{name} {ms:.2f}" for name, ms in report["cpu_ms_per_turn"].items()))
    worst = max(report["overhead_vs_socket_ms"]["mcp-stdio"], report["overhead_vs_socket_ms"]["mcp-http"])
    print(f"MCP adds {worst:.2f} ms at most (goal < {GOAL_MS:g} ms): {'met' if worst < GOAL_MS else 'NOT met'}")
    tokens = report["tool_list_tokens"]
    print(f"tool list: {tokens} tokens (goal < {TOKEN_GOAL}): {'met' if tokens < TOKEN_GOAL else 'NOT met'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=("bench", "stub"), default="bench", help=argparse.SUPPRESS)
    parser.add_argument("-n", type=int, default=40, help="turns per way per round")
    parser.add_argument("--asks", type=int, default=10, help="`ksi ask` processes per round")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    args = parser.parse_args()
    if args.role == "stub":
        serve_stub()
        return 0
    report = asyncio.run(bench(args))
    show(report)
    write_results("mcp_overhead", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
