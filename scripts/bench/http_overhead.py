"""What the HTTP front costs over calling litellm directly, side by side with litellm's own proxy.

    .venv/bin/python scripts/bench/http_overhead.py [-n 200] [--repeats 3] [--clients 20]
                                                    [--proxy-python PATH] [--quick] [--shapes a,b]

Separate processes, so each CPU figure belongs to one process only:
  stub       tests/stub_openai.py, a local OpenAI-compatible server answering at once (its CPU
             is never counted);
  direct     the baseline: `litellm.acompletion(model="openai/stub-model", api_base=stub, ...)`
             in a loop, one call in flight; CPU is that process's time.process_time();
  ksi        `python -m ksi_daemon --quiet --http 127.0.0.1:PORT` (KSI_FSYNC=never, and a second
             daemon with KSI_FSYNC=always), driven over HTTP: POST /v1/responses;
  proxy      litellm's own proxy (`litellm[proxy]` at the daemon's litellm version, in its own
             virtualenv: --proxy-python), no database, POST /v1/chat/completions;
  forwarder  a bare Starlette/uvicorn app that hands /v1/chat/completions to litellm.acompletion
             and returns the reply: the least any HTTP front over litellm can cost.
CPU of a server is psutil's user+system time of its process tree around N requests.

Shapes (one request in flight, the same messages reach the stub in every column):
  new        a new conversation per request (one user message);
  continue   10 conversations in turn: KSI continues each by previous_response_id and rebuilds the
             history itself; direct, proxy and forwarder are sent the whole history by the client;
  client     the client holds the history: 10 conversations in turn, each opened (untimed) with 10
             turns the client already held, then every request resends all of it; KSI is sent a
             Responses `input` list, finds the stored conversation and appends the new turn;
             direct, proxy and forwarder get the same messages;
  client-chat  the same, sent to KSI as a chat completions `messages` list;
  ttft       streaming, time to the first text: KSI's first `response.output_text.delta` event,
             the first content chunk elsewhere;
  throughput `--clients` concurrent HTTP clients, new conversations, requests per second.
Everything is warmed up first; rounds are interleaved (rotating the order) and the table shows
medians over `--repeats` rounds; "added" is the median of per-round differences to direct.
Prints tables and writes scripts/bench/results/http_overhead.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import (
    STUB_MODEL,
    DirectWorker,
    StubProcess,
    free_port,
    machine,
    prompt,
    quiet_litellm,
    rotated,
    serve_batches,
    serve_stub,
    stub_env,
    stub_models,
    write_results,
)

TOKEN = "sk-bench-token-0123456789"  # litellm's proxy wants its master key to start with sk-
CONVERSATIONS = 10
HISTORY_TURNS = 10  # turns a client-held conversation starts with
SHAPES = ("new", "continue", "client", "client-chat", "ttft")
CLIENT_SHAPES = ("client", "client-chat")


def held_history(slot: int, offset: int) -> list[dict[str, str]]:
    """The turns a client already holds when it opens conversation `slot` (the same for every path,
    a different conversation for every batch)."""
    chat: list[dict[str, str]] = []
    for turn in range(HISTORY_TURNS):
        chat += [{"role": "user", "content": prompt(offset + 1000 * slot + turn)},
                 {"role": "assistant", "content": f"answer {turn} of conversation {offset}-{slot}"}]
    return chat


# -- role: direct litellm ------------------------------------------------------------------------
def serve_direct(api_base: str) -> None:
    """Read `SHAPE COUNT OFFSET` lines; answer each with CPU ms and the per-call wall ms as JSON."""
    litellm = quiet_litellm()

    async def call(messages: list[dict[str, str]]) -> str:
        reply = await litellm.acompletion(model=STUB_MODEL, api_base=api_base, api_key="x", messages=messages,
                                          max_retries=0)
        return reply.choices[0].message.content or ""

    async def first_token(text: str) -> float:
        start = time.perf_counter()
        stream = await litellm.acompletion(model=STUB_MODEL, api_base=api_base, api_key="x", max_retries=0,
                                           messages=[{"role": "user", "content": text}], stream=True)
        first = None
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - start
        return (first or 0.0) * 1000

    async def batch(shape: str, count: int, offset: int) -> dict[str, Any]:
        chats: list[list[dict[str, str]]] = [
            held_history(slot, offset) if shape in CLIENT_SHAPES else [] for slot in range(CONVERSATIONS)]
        walls: list[float] = []
        cpu0 = time.process_time()
        for i in range(count):
            text = prompt(offset + i)
            start = time.perf_counter()
            if shape == "new":
                await call([{"role": "user", "content": text}])
            elif shape == "continue" or shape in CLIENT_SHAPES:
                chat = chats[i % CONVERSATIONS]
                chat.append({"role": "user", "content": text})
                chat.append({"role": "assistant", "content": await call(list(chat))})
            else:
                walls.append(await first_token(text))
                continue
            walls.append((time.perf_counter() - start) * 1000)
        return {"cpu_ms": (time.process_time() - cpu0) * 1000 / count, "walls": walls}

    serve_batches(batch)


# -- role: bare forwarder -------------------------------------------------------------------------
def serve_forwarder(api_base: str, port: int) -> None:
    """/v1/chat/completions -> litellm.acompletion -> JSON (or SSE), nothing else."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    litellm = quiet_litellm()

    async def chat(request: Request) -> Response:
        body = await request.json()
        if body.get("stream"):
            stream = await litellm.acompletion(model=STUB_MODEL, api_base=api_base, api_key="x", max_retries=0,
                                               messages=body["messages"], stream=True)

            async def chunks() -> Any:
                async for chunk in stream:
                    yield b"data: " + chunk.model_dump_json().encode() + b"\n\n"
                yield b"data: [DONE]\n\n"

            return StreamingResponse(chunks(), media_type="text/event-stream")
        reply = await litellm.acompletion(model=STUB_MODEL, api_base=api_base, api_key="x", max_retries=0,
                                          messages=body["messages"])
        return JSONResponse(reply.model_dump())

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, http="h11")


# -- servers --------------------------------------------------------------------------------------
class Server:
    """An HTTP server process (or tree) under measurement, and how to talk to it."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], url: str, kind: str) -> None:
        self.name, self.url, self.kind = name, url, kind
        self.process = subprocess.Popen(command, env=env, cwd=tempfile.gettempdir(), stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def cpu_seconds(self) -> float:
        import psutil

        total = 0.0
        try:
            root = psutil.Process(self.process.pid)
            for proc in [root, *root.children(recursive=True)]:
                times = proc.cpu_times()
                total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
        return total

    async def wait_ready(self, client: Any, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                error = self.process.stderr.read().decode(errors="replace")[-800:] if self.process.stderr else ""
                raise RuntimeError(f"{self.name} exited: {error}")
            try:
                await one_request(self, client, "new", prompt(0), None)
                return
            except Exception:
                await asyncio.sleep(0.25)
        raise RuntimeError(f"{self.name} did not answer within {timeout}s")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()


async def one_request(server: Server, client: Any, shape: str, text: str, state: Any) -> Any:
    """One request of `shape`; returns what continuing needs (a response id or the history)."""
    if server.kind == "ksi" and shape == "client":
        items = [*state, {"role": "user", "content": text}]
        reply = await client.post(f"{server.url}/v1/responses", json={"model": STUB_MODEL, "input": items})
        reply.raise_for_status()
        answer = reply.json()["output"][0]["content"][0]["text"]
        return [*items, {"role": "assistant", "content": answer}]
    if server.kind == "ksi" and shape != "client-chat":
        body: dict[str, Any] = {"model": STUB_MODEL, "input": text}
        if shape == "continue" and state:
            body["previous_response_id"] = state
        reply = await client.post(f"{server.url}/v1/responses", json=body)
        reply.raise_for_status()
        return reply.json()["id"]
    messages = [*(state or []), {"role": "user", "content": text}] if shape != "new" else \
        [{"role": "user", "content": text}]
    reply = await client.post(f"{server.url}/v1/chat/completions", json={"model": STUB_MODEL, "messages": messages})
    reply.raise_for_status()
    answer = reply.json()["choices"][0]["message"]["content"]
    return [*messages, {"role": "assistant", "content": answer}]


async def first_text_ms(server: Server, client: Any, text: str) -> float:
    start = time.perf_counter()
    if server.kind == "ksi":
        request = client.stream("POST", f"{server.url}/v1/responses", json={"model": STUB_MODEL, "input": text,
                                                                             "stream": True})
        marker = "event: response.output_text.delta"
    else:
        request = client.stream("POST", f"{server.url}/v1/chat/completions",
                                json={"model": STUB_MODEL, "messages": [{"role": "user", "content": text}],
                                      "stream": True})
        marker = '"content":"'
    first = None
    async with request as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if first is None and marker in line.replace('": "', '":"') and '"content":""' not in line.replace(
                    '": "', '":"'):
                first = time.perf_counter() - start
    return (first or 0.0) * 1000


async def batch(server: Server, client: Any, shape: str, count: int, offset: int) -> dict[str, Any]:
    states: list[Any] = [None] * CONVERSATIONS
    if shape in CLIENT_SHAPES:  # each conversation opened with the turns its client holds, untimed
        for slot in range(CONVERSATIONS):
            held = held_history(slot, offset)
            states[slot] = await one_request(server, client, shape, held[-2]["content"], held[:-2])
    walls: list[float] = []
    cpu0 = server.cpu_seconds()
    for i in range(count):
        text = prompt(offset + i)
        if shape == "ttft":
            walls.append(await first_text_ms(server, client, text))
            continue
        start = time.perf_counter()
        slot = i % CONVERSATIONS
        states[slot] = await one_request(server, client, shape, text, states[slot])
        walls.append((time.perf_counter() - start) * 1000)
    return {"cpu_ms": (server.cpu_seconds() - cpu0) * 1000 / count, "walls": walls}


async def throughput(server: Server, clients: int, total: int) -> float:
    import httpx

    counter = iter(range(total))

    async def worker() -> None:
        async with httpx.AsyncClient(timeout=60, headers={"Authorization": f"Bearer {TOKEN}"}) as client:
            for i in counter:
                await one_request(server, client, "new", prompt(i), None)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    return total / (time.perf_counter() - start)


def proxy_config(path: Path, api_base: str) -> None:
    path.write_text(json.dumps({
        "model_list": [{"model_name": STUB_MODEL, "litellm_params": {"model": STUB_MODEL, "api_base": api_base,
                                                                 "api_key": "x", "max_retries": 0}}],
        "litellm_settings": {"drop_params": True, "telemetry": False},
        "general_settings": {"master_key": TOKEN},  # the proxy refuses to start without one
    }))


def start_servers(api_base: str, work: Path, proxy_python: str | None) -> tuple[list[Server], str | None]:
    servers = []
    for fsync in ("never", "always"):
        port = free_port()
        var = work / f"ksi-{fsync}"
        env = stub_env(KSI_MODELS=stub_models(api_base), KSI_DEFAULT_MODEL=STUB_MODEL, KSI_HTTP_TOKEN=TOKEN,
                       KSI_FSYNC=fsync)
        servers.append(Server(f"ksi (fsync {fsync})", [sys.executable, "-m", "ksi_daemon", "--quiet", "--var-dir",
                                                      str(var), "--socket", str(var / "d.sock"), "--http",
                                                      f"127.0.0.1:{port}"], env, f"http://127.0.0.1:{port}", "ksi"))
    port = free_port()
    servers.append(Server("forwarder", [sys.executable, __file__, "--role", "forwarder", "--api-base", api_base,
                                        "--port", str(port)], stub_env(), f"http://127.0.0.1:{port}", "chat"))
    proxy_note = None
    if proxy_python and Path(proxy_python).exists():
        port = free_port()
        config = work / "proxy.json"
        proxy_config(config, api_base)
        proxy_bin = Path(proxy_python).parent / "litellm"
        servers.append(Server("litellm proxy", [str(proxy_bin), "--config", str(config), "--port", str(port),
                                                "--host", "127.0.0.1", "--num_workers", "1"],
                              stub_env(), f"http://127.0.0.1:{port}", "chat"))
    else:
        proxy_note = f"litellm[proxy] not found at {proxy_python}; compared with the bare forwarder only"
    return servers, proxy_note


async def measure(args: argparse.Namespace, api_base: str, work: Path) -> dict[str, Any]:
    import httpx

    servers, proxy_note = start_servers(api_base, work, args.proxy_python)
    direct = DirectWorker(__file__, "--api-base", api_base)
    results: dict[str, Any] = {"proxy_note": proxy_note, "rounds": []}
    try:
        async with httpx.AsyncClient(timeout=60, headers={"Authorization": f"Bearer {TOKEN}"}) as client:
            for server in servers:
                await server.wait_ready(client)
            for shape in args.shapes:  # warm-up: first calls, imports, connections
                direct.batch(shape, 10, 10_000)
                for server in servers:
                    await batch(server, client, shape, 10, 10_000)
            names = ["direct", *(s.name for s in servers)]
            for round_no in range(args.repeats):
                row: dict[str, Any] = {}
                for shape in args.shapes:
                    for name in rotated(names, round_no):
                        offset = 100_000 * (round_no + 1)
                        if name == "direct":
                            got = direct.batch(shape, args.n, offset)
                        else:
                            server = next(s for s in servers if s.name == name)
                            got = await batch(server, client, shape, args.n, offset)
                        row[f"{shape}/{name}"] = {"median_ms": statistics.median(got["walls"]),
                                                  "cpu_ms": got["cpu_ms"]}
                results["rounds"].append(row)
                print(f"round {round_no + 1}/{args.repeats} done", file=sys.stderr)
        results["throughput"] = {}
        for server in servers:
            cpu0 = server.cpu_seconds()
            rate = await throughput(server, args.clients, args.total)
            results["throughput"][server.name] = {"requests_per_s": rate,
                                                  "cpu_ms": (server.cpu_seconds() - cpu0) * 1000 / args.total}
    finally:
        direct.close()
        for server in servers:
            server.stop()
    results["servers"] = [s.name for s in servers]
    return results


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    rounds = results["rounds"]
    table: dict[str, Any] = {}
    for shape in (shape for shape in SHAPES if f"{shape}/direct" in rounds[0]):
        for name in ["direct", *results["servers"]]:
            key = f"{shape}/{name}"
            entry = {"median_ms": statistics.median(r[key]["median_ms"] for r in rounds),
                     "cpu_ms": statistics.median(r[key]["cpu_ms"] for r in rounds)}
            if name != "direct":
                base = f"{shape}/direct"
                entry["added_ms"] = statistics.median(r[key]["median_ms"] - r[base]["median_ms"] for r in rounds)
                entry["added_cpu_ms"] = statistics.median(r[key]["cpu_ms"] - r[base]["cpu_ms"] for r in rounds)
            table[key] = entry
    return table


def print_tables(table: dict[str, Any], results: dict[str, Any]) -> None:
    print(f"\n{'shape':<11} {'path':<20} {'median ms':>10} {'added ms':>9} {'CPU ms/req':>11} {'added CPU':>10}")
    for key, entry in table.items():
        shape, name = key.split("/", 1)
        added = f"{entry['added_ms']:+.2f}" if "added_ms" in entry else ""
        added_cpu = f"{entry['added_cpu_ms']:+.2f}" if "added_cpu_ms" in entry else ""
        print(f"{shape:<11} {name:<20} {entry['median_ms']:>10.2f} {added:>9} {entry['cpu_ms']:>11.2f} {added_cpu:>10}")
    print(f"\n{'throughput':<20} {'req/s':>8} {'CPU ms/req':>11}")
    for name, entry in results["throughput"].items():
        print(f"{name:<20} {entry['requests_per_s']:>8.0f} {entry['cpu_ms']:>11.2f}")
    if results.get("proxy_note"):
        print(f"\nnote: {results['proxy_note']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--role", choices=["stub", "direct", "forwarder"])
    parser.add_argument("--api-base")
    parser.add_argument("--port", type=int)
    parser.add_argument("-n", type=int, default=200, help="requests per shape, path and round")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--total", type=int, default=1000, help="requests in the throughput run")
    parser.add_argument("--proxy-python", default=str(Path(tempfile.gettempdir()) / "litellm-proxy-venv" / "bin"
                                                      / "python"), help="python of the litellm[proxy] virtualenv")
    parser.add_argument("--quick", action="store_true", help="-n 30 --repeats 1 --total 200")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"some of {','.join(SHAPES)}")
    args = parser.parse_args()
    args.shapes = [shape for shape in SHAPES if shape in args.shapes.split(",")]
    if args.role == "stub":
        return serve_stub()
    if args.role == "direct":
        return serve_direct(args.api_base)
    if args.role == "forwarder":
        return serve_forwarder(args.api_base, args.port)
    if args.quick:
        args.n, args.repeats, args.total = 30, 1, 200
    stub = StubProcess(__file__)
    work = Path(tempfile.mkdtemp(prefix="ksi-bench-http-"))
    try:
        results = asyncio.run(measure(args, stub.api_base, work))
    finally:
        stub.stop()
        shutil.rmtree(work, ignore_errors=True)
    table = summarize(results)
    print_tables(table, results)
    write_results("http_overhead", {
        "machine": machine(),
        "settings": {"n": args.n, "repeats": args.repeats, "clients": args.clients, "total": args.total,
                     "shapes": args.shapes},
        "table": table, "throughput": results["throughput"], "proxy_note": results.get("proxy_note"),
        "rounds": results["rounds"],
    })


if __name__ == "__main__":
    main()
