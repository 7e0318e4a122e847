"""A tool-calling rollout over the Responses WebSocket mode against the same over HTTP.

    .venv/bin/python scripts/bench/responses_websocket.py [--calls 25] [--repeats 5]

Separate processes: the stub (tests/stub_openai.py answering at once, every turn that carries
tools with one call of its first tool, streamed, as a model in a tool loop) and one daemon
(`python -m ksi_daemon --quiet --http 127.0.0.1:PORT`). One client process drives a rollout of
`--calls` tool calls, a call's output answering each, three ways, one response in flight:
  ws          one WebSocket to /v1/responses: response.create with previous_response_id and only
              the new function_call_output (Codex's WebSocket mode);
  http-full   POST /v1/responses, streamed, the whole history resent each turn with no item ids
              (Codex's HTTP mode: KSI finds the stored conversation by its digests);
  http-chain  POST /v1/responses, streamed, previous_response_id and only the new item (a client
              that chains over HTTP: the transport alone differs from ws).
Each round runs one rollout per way (a new conversation each), in rotated order; the table gives
medians over `--repeats` rounds of the rollout's wall time, its ratio to http-full's in the same
round, and the daemon's CPU per continued turn (psutil, the daemon process only; the first turn
of a rollout, which opens the conversation, is left out). Writes
scripts/bench/results/responses_websocket.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import (
    STUB_MODEL,
    Daemon,
    StubProcess,
    bench_tools,
    free_port,
    machine,
    rotated,
    tool_output,
    write_results,
)

TOKEN = "ksi-bench-token-0123456789"
WAYS = ("ws", "http-full", "http-chain")
TOOLS = bench_tools(3)


def serve_tool_stub() -> None:
    """`--role stub`: the test stub, whose every turn carrying tools is one call of its first tool,
    streamed or not (harness.serve_stub answers streamed turns with text)."""
    import sys
    import uuid

    from aiohttp import web
    from harness import _Discard

    from tests.stub_openai import Reply, StubOpenAI

    class StreamedToolStub(StubOpenAI):
        async def _chat(self, request: web.Request) -> web.StreamResponse:
            body = await request.json()
            if body.get("tools"):
                name = body["tools"][0]["function"]["name"]
                self.script.append(Reply(calls=[{"id": f"call_{uuid.uuid4().hex[:12]}", "name": name,
                                                 "arguments": {"city": "Lyon", "count": 2}}]))
            return await super()._chat(request)  # aiohttp keeps the body read above

    async def main() -> None:
        async with StreamedToolStub() as server:
            server.requests = _Discard()
            server.headers = _Discard()
            print(server.api_base, flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)

    asyncio.run(main())


def first_input(round_no: int, way: str) -> list[dict[str, Any]]:
    return [{"type": "message", "role": "user", "content": f"Round {round_no} ({way}): look up facts of 25 cities."}]


def call_of(response: dict[str, Any]) -> dict[str, Any]:
    (call,) = [item for item in response["output"] if item["type"] == "function_call"]
    return call


def answer(call: dict[str, Any], turn: int) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call["call_id"], "output": tool_output(call["call_id"], turn)}


async def ws_rollout(url: str, calls: int, round_no: int, daemon: Daemon) -> tuple[float, float]:
    """Wall seconds of the rollout and the daemon's CPU seconds over its continued turns."""
    from websockets.asyncio.client import connect

    async def turn(ws: Any, **fields: Any) -> dict[str, Any]:
        await ws.send(json.dumps({"type": "response.create", "model": STUB_MODEL, "tools": TOOLS, **fields}))
        while True:
            event = json.loads(await ws.recv())
            if event["type"] in ("response.completed", "response.failed", "error"):
                assert event["type"] == "response.completed", event
                return dict(event["response"])

    started = time.perf_counter()
    async with connect(url, additional_headers={"Authorization": f"Bearer {TOKEN}"}) as ws:
        response = await turn(ws, input=first_input(round_no, "ws"))
        cpu = daemon.cpu_s()
        for n in range(1, calls):
            response = await turn(ws, previous_response_id=response["id"], input=[answer(call_of(response), n)])
        cpu = daemon.cpu_s() - cpu
    return time.perf_counter() - started, cpu


async def http_turn(client: Any, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed POST /v1/responses; its final Response object."""
    async with client.stream("POST", "/v1/responses", json={"model": STUB_MODEL, "tools": TOOLS, "stream": True,
                                                             **body}) as reply:
        async for line in reply.aiter_lines():
            if line.startswith("data:") and '"response.completed"' in line:
                return dict(json.loads(line[5:])["response"])
    raise AssertionError(f"no response.completed ({reply.status_code})")


def as_sent_back(call: dict[str, Any]) -> dict[str, Any]:
    """A function_call item as a client that keeps no item ids sends it again."""
    return {"type": "function_call", "call_id": call["call_id"], "name": call["name"], "arguments": call["arguments"]}


async def http_rollout(client: Any, way: str, calls: int, round_no: int, daemon: Daemon) -> tuple[float, float]:
    started = time.perf_counter()
    history = first_input(round_no, way)
    response = await http_turn(client, {"input": history})
    cpu = daemon.cpu_s()
    for n in range(1, calls):
        call = call_of(response)
        if way == "http-full":
            history = [*history, as_sent_back(call), answer(call, n)]
            response = await http_turn(client, {"input": history})
        else:
            response = await http_turn(client, {"previous_response_id": response["id"], "input": [answer(call, n)]})
    return time.perf_counter() - started, daemon.cpu_s() - cpu


async def measure(args: argparse.Namespace, api_base: str, work: Path) -> dict[str, Any]:
    import httpx

    port = free_port()
    daemon = Daemon(api_base, work, env={"KSI_HTTP_TOKEN": TOKEN}, args=["--http", f"127.0.0.1:{port}"])
    base = f"http://127.0.0.1:{port}"
    rounds: list[dict[str, Any]] = []
    try:
        await daemon.connect()
        async with httpx.AsyncClient(base_url=base, timeout=60, headers={"Authorization": f"Bearer {TOKEN}"}) as client:

            async def rollout(way: str, round_no: int) -> tuple[float, float]:
                if way == "ws":
                    return await ws_rollout(base.replace("http", "ws") + "/v1/responses", args.calls, round_no, daemon)
                return await http_rollout(client, way, args.calls, round_no, daemon)

            for way in WAYS:  # warm-up: imports, first calls, connections
                await rollout(way, -1)
            for round_no in range(args.repeats):
                measured = {}
                for way in rotated(WAYS, round_no):
                    wall, cpu = await rollout(way, round_no)
                    measured[way] = {"wall_s": wall, "cpu_ms_per_turn": cpu * 1000 / (args.calls - 1)}
                rounds.append(measured)
                print(f"round {round_no + 1}: " + ", ".join(f"{w} {m['wall_s'] * 1000:.0f} ms" for w, m in measured.items()))
    finally:
        await daemon.stop()
    return {"calls": args.calls, "repeats": args.repeats, "rounds": rounds}


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    rounds = results["rounds"]
    table = {}
    for way in WAYS:
        table[way] = {
            "wall_ms": statistics.median(r[way]["wall_s"] * 1000 for r in rounds),
            "vs_http_full": statistics.median(r[way]["wall_s"] / r["http-full"]["wall_s"] for r in rounds),
            "vs_http_chain": statistics.median(r[way]["wall_s"] / r["http-chain"]["wall_s"] for r in rounds),
            "cpu_ms_per_turn": statistics.median(r[way]["cpu_ms_per_turn"] for r in rounds),
            "cpu_vs_http_full": statistics.median(r[way]["cpu_ms_per_turn"] / r["http-full"]["cpu_ms_per_turn"]
                                                  for r in rounds),
            "cpu_vs_http_chain": statistics.median(r[way]["cpu_ms_per_turn"] / r["http-chain"]["cpu_ms_per_turn"]
                                                   for r in rounds),
        }
    ws = table["ws"]
    table["goals"] = {"ws_30pct_faster_than_http_full": ws["vs_http_full"] <= 0.7,
                      "ws_cpu_per_turn_not_above_http_full": ws["cpu_vs_http_full"] <= 1.0,
                      "ws_cpu_per_turn_not_above_http_chain": ws["cpu_vs_http_chain"] <= 1.0}
    return table


def print_table(table: dict[str, Any], calls: int) -> None:
    print(f"\n{calls}-tool-call rollout, medians over rounds")
    print(f"{'way':<11} {'wall ms':>9} {'/ http-full':>12} {'/ http-chain':>13} {'cpu ms/turn':>12} "
          f"{'cpu / full':>11} {'cpu / chain':>12}")
    for way in WAYS:
        row = table[way]
        print(f"{way:<11} {row['wall_ms']:>9.0f} {row['vs_http_full']:>12.2f} {row['vs_http_chain']:>13.2f} "
              f"{row['cpu_ms_per_turn']:>12.2f} {row['cpu_vs_http_full']:>11.2f} {row['cpu_vs_http_chain']:>12.2f}")
    for goal, met in table["goals"].items():
        print(f"{goal}: {'met' if met else 'MISSED'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--role", choices=["stub"])
    parser.add_argument("--calls", type=int, default=25, help="tool calls in a rollout")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.role == "stub":
        return serve_tool_stub()
    stub = StubProcess(__file__)
    work = Path(tempfile.mkdtemp(prefix="ksi-bench-ws-"))
    try:
        results = asyncio.run(measure(args, stub.api_base, work))
    finally:
        stub.stop()
        shutil.rmtree(work, ignore_errors=True)
    table = summarize(results)
    print_table(table, args.calls)
    write_results("responses_websocket", {"machine": machine(), "table": table, **results})


if __name__ == "__main__":
    main()
