"""What a turn through the Messages door adds, against the same turn on /v1/responses, in one run.

    .venv/bin/python scripts/bench/messages_overhead.py [-n 200] [--repeats 3] [--block 10] [--quick]

Separate processes, so each CPU figure belongs to one process only:
  stub       tests/stub_openai.py answering at once (its CPU is never counted);
  direct     the baseline: `litellm.acompletion` against the stub, one call in flight;
  ksi        one daemon (`--http`, KSI_FSYNC=never) driven over HTTP through both doors:
             POST /v1/responses (an `input` list) and POST /v1/messages (a `messages` list);
  proxy      litellm's own proxy (`litellm[proxy]` in its own virtualenv, --proxy-python; left out
             when it is not there), no database, POST /v1/messages: stateless, sent everything.
Shapes (one request in flight, the same messages reach the stub on every path):
  new        a new conversation per request (one user message);
  client     the client holds the history: 10 conversations in turn, each opened (untimed) with
             10 turns the client already held, then every request resends all of it and KSI
             finds the stored conversation and appends the new turn.
Rounds are interleaved, and within a round the paths take turns in blocks of --block requests
(rotating who goes first), so that the load of other work on the machine, which changes within
seconds, falls on every path alike. "added" is the median over rounds of a path's median wall
time minus direct's; the goal: the Messages door's added latency at most 1.1x the Responses
door's, per shape, and less than litellm's proxy adds. Each server's CPU per request is shown
beside it.
Prints a table and writes scripts/bench/results/messages_overhead.json.
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
    process_cpu_s,
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
HISTORY_TURNS = 10
SHAPES = ("new", "client")
DOORS = ("responses", "messages")
GOAL = 1.1
WARM_UP = 50  # requests per shape and path before the rounds: first calls, imports, connections, caches
MAX_TOKENS = 256  # the Messages API requires it: both doors send it, so both turns ask the same


def held_history(slot: int, offset: int) -> list[dict[str, str]]:
    """The turns a client holds when it opens conversation `slot` (one per batch and slot)."""
    chat: list[dict[str, str]] = []
    for turn in range(HISTORY_TURNS):
        chat += [{"role": "user", "content": prompt(offset + 1000 * slot + turn)},
                 {"role": "assistant", "content": f"answer {turn} of conversation {offset}-{slot}"}]
    return chat


def serve_direct(api_base: str) -> None:
    """Read `SHAPE COUNT OFFSET` lines; answer each with the per-call wall ms as JSON. A batch with
    an offset seen before continues that one's conversations (a round's blocks, see Player)."""
    litellm = quiet_litellm()
    chats: dict[int, list[list[dict[str, str]]]] = {}
    sent: dict[int, int] = {}

    async def batch(shape: str, count: int, offset: int) -> dict[str, Any]:
        held = chats.setdefault(offset, [held_history(slot, offset) if shape == "client" else []
                                         for slot in range(CONVERSATIONS)])
        first = sent.get(offset, 0)
        sent[offset] = first + count
        walls: list[float] = []
        for i in range(first, first + count):
            chat = held[i % CONVERSATIONS] if shape == "client" else []
            chat.append({"role": "user", "content": prompt(offset + i)})
            start = time.perf_counter()
            reply = await litellm.acompletion(model=STUB_MODEL, api_base=api_base, api_key="x", messages=list(chat),
                                              max_retries=0)
            walls.append((time.perf_counter() - start) * 1000)
            chat.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
        return {"walls": walls}

    serve_batches(batch)


async def turn(client: Any, url: str, door: str, history: list[dict[str, str]], text: str) -> list[dict[str, str]]:
    """One turn through `door` with the client's `history`; the history with this turn added."""
    sent = [*history, {"role": "user", "content": text}]
    if door == "responses":
        reply = await client.post(f"{url}/v1/responses", json={"model": STUB_MODEL, "input": sent,
                                                                 "max_output_tokens": MAX_TOKENS})
        reply.raise_for_status()
        answer = reply.json()["output"][0]["content"][0]["text"]
    else:
        reply = await client.post(f"{url}/v1/messages", json={"model": STUB_MODEL, "max_tokens": MAX_TOKENS,
                                                                "messages": sent})
        reply.raise_for_status()
        answer = reply.json()["content"][0]["text"]
    return [*sent, {"role": "assistant", "content": answer}]


class DirectPlayer:
    """The direct litellm loop's part of one round and shape: its batches continue one another."""

    def __init__(self, worker: DirectWorker, shape: str, offset: int) -> None:
        self.worker, self.shape, self.offset = worker, shape, offset
        self.walls: list[float] = []
        self.cpu_ms: float | None = None

    async def open(self) -> None:
        pass  # the worker opens its conversations with the history its client holds, untimed

    async def run(self, count: int) -> None:
        self.walls += self.worker.batch(self.shape, count, self.offset)["walls"]


class Player:
    """One server door's part of one round and shape: its conversations (each opened, untimed, with
    the turns its client holds) go on from block to block; its wall times and the server's CPU."""

    def __init__(self, client: Any, server: Any, url: str, door: str, shape: str, offset: int) -> None:
        self.client, self.server, self.url = client, server, url
        self.door, self.shape, self.offset = door, shape, offset
        self.states: list[list[dict[str, str]]] = [[] for _ in range(CONVERSATIONS)]
        self.walls: list[float] = []
        self.cpu_s = 0.0

    @property
    def cpu_ms(self) -> float:
        return self.cpu_s * 1000 / max(1, len(self.walls))

    async def open(self) -> None:
        if self.shape == "client":
            for slot in range(CONVERSATIONS):
                held = held_history(slot, self.offset)
                self.states[slot] = await turn(self.client, self.url, self.door, held[:-2], held[-2]["content"])

    async def run(self, count: int) -> None:
        cpu0 = process_cpu_s(self.server)
        first = len(self.walls)
        for i in range(first, first + count):
            slot = i % CONVERSATIONS
            start = time.perf_counter()
            held = await turn(self.client, self.url, self.door, self.states[slot] if self.shape == "client" else [],
                              prompt(self.offset + i))
            self.walls.append((time.perf_counter() - start) * 1000)
            self.states[slot] = held
        self.cpu_s += process_cpu_s(self.server) - cpu0


async def play(players: dict[str, DirectPlayer | Player], count: int, block: int, round_no: int) -> None:
    """`count` requests of every player, in blocks of `block` taken in turn (who goes first rotating)."""
    for player in players.values():
        await player.open()
    for block_no, done in enumerate(range(0, count, block)):
        for name in rotated(list(players), round_no + block_no):
            await players[name].run(min(block, count - done))


async def wait_ready(client: Any, url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url} exited")
        try:
            await turn(client, url, "messages", [], "ready?")
            return
        except Exception:
            await asyncio.sleep(0.25)
    raise RuntimeError(f"{url} did not answer")


def proxy_config(path: Path, api_base: str) -> None:
    # the proxy's /v1/messages sends an `openai/` model through the Responses API, which the stub
    # (like most local servers) lacks; `hosted_vllm/` reaches it by chat completions, as KSI does
    path.write_text(json.dumps({
        "model_list": [{"model_name": STUB_MODEL, "litellm_params": {"model": "hosted_vllm/stub-model", "api_base": api_base,
                                                                 "api_key": "x", "max_retries": 0}}],
        "litellm_settings": {"telemetry": False},
        "general_settings": {"master_key": TOKEN},  # the proxy refuses to start without one
    }))


def start_servers(args: argparse.Namespace, api_base: str, work: Path) -> dict[str, tuple[str, subprocess.Popen[bytes]]]:
    """The KSI daemon and, when its virtualenv is there, litellm's proxy: name -> (url, process)."""
    port = free_port()
    env = stub_env(KSI_MODELS=stub_models(api_base), KSI_DEFAULT_MODEL=STUB_MODEL, KSI_HTTP_TOKEN=TOKEN,
                   KSI_FSYNC="never")
    servers = {"ksi": (f"http://127.0.0.1:{port}", subprocess.Popen(
        [sys.executable, "-m", "ksi_daemon", "--quiet", "--var-dir", str(work / "var"), "--socket",
         str(work / "d.sock"), "--http", f"127.0.0.1:{port}"], env=env, cwd=work, stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL))}
    proxy_bin = Path(args.proxy_python).parent / "litellm"
    if proxy_bin.exists():
        port = free_port()
        proxy_config(work / "proxy.json", api_base)
        servers["proxy"] = (f"http://127.0.0.1:{port}", subprocess.Popen(
            [str(proxy_bin), "--config", str(work / "proxy.json"), "--port", str(port), "--host", "127.0.0.1",
             "--num_workers", "1"], env=stub_env(), cwd=work, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL))
    return servers


async def measure(args: argparse.Namespace, api_base: str, work: Path) -> list[dict[str, Any]]:
    import httpx
    import psutil

    servers = start_servers(args, api_base, work)
    # path -> (server, door): KSI through both doors, litellm's proxy through its /v1/messages
    paths = {door: ("ksi", door) for door in DOORS} | ({"litellm proxy": ("proxy", "messages")}
                                                        if "proxy" in servers else {})
    direct = DirectWorker(__file__, "--api-base", api_base)
    rounds: list[dict[str, Any]] = []
    try:
        async with httpx.AsyncClient(timeout=60, headers={"Authorization": f"Bearer {TOKEN}"}) as client:
            for url, process in servers.values():
                await wait_ready(client, url, process)
            watched = {name: psutil.Process(process.pid) for name, (_url, process) in servers.items()}

            def players(shape: str, base: int) -> dict[str, DirectPlayer | Player]:
                # offsets 10,000 apart: no two conversations hold the same prompts (see held_history)
                made: dict[str, DirectPlayer | Player] = {"direct": DirectPlayer(direct, shape, base + 90_000)}
                for number, (path, (server, door)) in enumerate(paths.items()):
                    made[path] = Player(client, watched[server], servers[server][0], door, shape,
                                        base + 10_000 * number)
                return made

            for shape in args.shapes:  # warm-up: first calls, imports, connections
                await play(players(shape, 100_000 * (args.repeats + 1)), WARM_UP, args.block, 0)
            for round_no in range(args.repeats):
                row: dict[str, Any] = {}
                for shape in args.shapes:
                    played = players(shape, 100_000 * (round_no + 1))
                    await play(played, args.n, args.block, round_no)
                    for path, player in played.items():
                        row[f"{shape}/{path}"] = {"median_ms": statistics.median(player.walls),
                                                  "cpu_ms": player.cpu_ms}
                rounds.append(row)
                print(f"round {round_no + 1}/{args.repeats} done", file=sys.stderr)
    finally:
        direct.close()
        for _url, process in servers.values():
            process.terminate()
            process.wait(30)
    return rounds


def paths_of(rounds: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(key.split("/", 1)[1] for key in rounds[0] if not key.endswith("/direct")))


def summarize(rounds: list[dict[str, Any]], shapes: list[str]) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for shape in shapes:
        base = f"{shape}/direct"
        table[base] = {"median_ms": statistics.median(r[base]["median_ms"] for r in rounds)}
        for path in paths_of(rounds):
            key = f"{shape}/{path}"
            table[key] = {"median_ms": statistics.median(r[key]["median_ms"] for r in rounds),
                          "added_ms": statistics.median(r[key]["median_ms"] - r[base]["median_ms"] for r in rounds),
                          "cpu_ms": statistics.median(r[key]["cpu_ms"] for r in rounds)}
        responses, messages = table[f"{shape}/responses"], table[f"{shape}/messages"]
        # with no latency added by the Responses door (within noise), its whole turn is the yardstick
        ratio = messages["added_ms"] / responses["added_ms"] if responses["added_ms"] > 0 else None
        whole = messages["median_ms"] / responses["median_ms"]
        table[f"{shape}/ratio"] = {"added_ratio": ratio, "turn_ratio": whole,
                                   "cpu_ratio": messages["cpu_ms"] / responses["cpu_ms"], "goal": GOAL,
                                   "met": (ratio if ratio is not None else whole) <= GOAL}
        if f"{shape}/litellm proxy" in table:
            proxy = table[f"{shape}/litellm proxy"]
            table[f"{shape}/ratio"]["below_proxy"] = messages["added_ms"] < proxy["added_ms"]
    return table


def print_table(table: dict[str, Any], shapes: list[str], paths: list[str]) -> None:
    print(f"\n{'shape':<8} {'path':<14} {'median ms':>10} {'added ms':>9} {'server CPU ms/req':>18}")
    for shape in shapes:
        for path in ("direct", *paths):
            entry = table[f"{shape}/{path}"]
            added = f"{entry['added_ms']:+.2f}" if "added_ms" in entry else ""
            cpu = f"{entry['cpu_ms']:.2f}" if "cpu_ms" in entry else ""
            print(f"{shape:<8} {path:<14} {entry['median_ms']:>10.2f} {added:>9} {cpu:>18}")
        ratio = table[f"{shape}/ratio"]
        added = f"{ratio['added_ratio']:.2f}x" if ratio["added_ratio"] is not None else "n/a (responses added none)"
        print(f"{shape:<8} messages/responses: added {added}, whole turn {ratio['turn_ratio']:.2f}x, "
              f"CPU {ratio['cpu_ratio']:.2f}x (goal <= {GOAL}x: {'met' if ratio['met'] else 'missed'})")
        if "below_proxy" in ratio:
            print(f"{shape:<8} messages adds {'less' if ratio['below_proxy'] else 'MORE'} than litellm's proxy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--role", choices=["stub", "direct"])
    parser.add_argument("--api-base")
    parser.add_argument("-n", type=int, default=200, help="requests per shape, path and round")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--block", type=int, default=10, help="requests a path sends before the next path's turn")
    parser.add_argument("--quick", action="store_true", help="-n 30 --repeats 1")
    parser.add_argument("--proxy-python", default=str(Path(tempfile.gettempdir()) / "litellm-proxy-venv" / "bin"
                                                      / "python"), help="python of a litellm[proxy] virtualenv")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"some of {','.join(SHAPES)}")
    args = parser.parse_args()
    args.shapes = [shape for shape in SHAPES if shape in args.shapes.split(",")]
    if args.role == "stub":
        return serve_stub()
    if args.role == "direct":
        return serve_direct(args.api_base)
    if args.quick:
        args.n, args.repeats = 30, 1
    stub = StubProcess(__file__)
    work = Path(tempfile.mkdtemp(prefix="ksi-bench-msg-", dir="/tmp"))
    try:
        rounds = asyncio.run(measure(args, stub.api_base, work))
    finally:
        stub.stop()
        shutil.rmtree(work, ignore_errors=True)
    table = summarize(rounds, args.shapes)
    print_table(table, args.shapes, paths_of(rounds))
    write_results("messages_overhead", {"machine": machine(), "n": args.n, "repeats": args.repeats,
                                        "table": table, "rounds": rounds})


if __name__ == "__main__":
    main()
