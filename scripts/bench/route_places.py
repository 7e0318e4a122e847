"""Places a `completion:async` passes from the socket to the conversation index append, at run time.

    .venv/bin/python scripts/bench/route_places.py [--shape new|continue] [--list] [--out PATH]
    .venv/bin/python scripts/bench/route_places.py --compare OLD.json NEW.json

Issue 39 counts the places (functions of ksi_daemon and ksi_common) a request passes through; a
static walk stops where the router's handler table and the job queue dispatch at run time, so
this one traces a real daemon instead:

- the daemon is this script's child (`python -m ksi_daemon`'s own `main`, its var dir a fresh temp
  dir, JSONL storage, no KSI_* or provider settings from the shell) with a profile hook installed
  in every thread before the daemon starts (sys.setprofile and threading.setprofile);
- a client on the Unix socket warms the daemon up first: a new conversation and a continued one
  on the built-in `echo/` model (litellm's import, lazy imports and first-time paths are then
  behind it), waits for both results and half a second more;
- then ONE `completion:async` (shape `new`: a new conversation; `continue`: the warm-up's
  conversation's third turn), whose frame carries a marker. The trace starts when
  `Connection.data_received` is entered with that marker and stops when the conversation store's
  `append_exchange` (storage/jsonl) is entered in that request's context (counted: the append is
  the last place). The client sends nothing until the trace is written.

A place counts when a Python function of ksi_daemon or ksi_common is entered in the request's
context: a context variable set for the duration of that `data_received` call, which every task,
timer and thread hand-off started from it inherits (asyncio copies the context into each task and
callback, `asyncio.to_thread` and the store's writer threads run work in a copy), so heartbeats and
other tasks are never counted. A place is a file and a qualified name (two lambdas of one function
are one place); comprehensions and generator expressions are not places (counted aside). Beside
it, "window" counts every package function entered in any thread between the two moments, on a
daemon otherwise idle: what the filter left out.

Prints a table (places, files), with `--list` every place in order of first entry; writes
scripts/bench/results/route_places.json (or --out). `--compare` prints the places of NEW that OLD
has not, grouped by file (`*`: a function of that name OLD passed elsewhere, moved). A run takes
a few seconds; the hook slows the daemon, which changes no count.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MARK = "route-places-probe-7f3a"
MODEL = "echo/places"
PACKAGES = ("ksi_daemon", "ksi_common")
START = ("transports/unix.py", "data_received")
STOP = ("storage/jsonl/conversations.py", "append_exchange")
NOT_PLACES = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>", "<module>")
CLEAN_PREFIXES = ("OPENAI_", "ANTHROPIC_", "GEMINI_", "GOOGLE_", "AZURE_", "OLLAMA_", "LITELLM_", "KSI_")


# -- the traced daemon (the child process) ------------------------------------------------------
class Trace:
    """The profile hook's state: waiting for the marked frame, tracing, then done."""

    def __init__(self, out: Path, package_dirs: list[str]) -> None:
        self.out = out
        self.prefixes = tuple(d.rstrip("/") + "/" for d in package_dirs)
        self.base = str(Path(package_dirs[0]).parent) + "/"
        self.start_file = package_dirs[0] + "/" + START[0]
        self.stop_file = package_dirs[0] + "/" + STOP[0]
        self.request: contextvars.ContextVar[bool] = contextvars.ContextVar("route_places_request", default=False)
        self.started = self.stopped = False
        self.start_frame: Any = None
        self.token: Any = None
        self.places: dict[str, dict[str, Any]] = {}  # in the request's context, in order of first entry
        self.window: dict[str, dict[str, Any]] = {}  # any context, any thread
        self.skipped: set[str] = set()

    def hook(self, frame: Any, event: str, _arg: Any) -> None:
        if event == "return" and frame is self.start_frame:  # the marked frame read: later reads are not the request
            self.request.reset(self.token)
            self.start_frame = None
            return
        if event != "call" or self.stopped:
            return
        code = frame.f_code
        if not self.started:
            if code.co_name != START[1] or code.co_filename != self.start_file:
                return
            if MARK.encode() not in bytes(frame.f_locals.get("data") or b""):
                return
            self.started, self.start_frame = True, frame
            self.token = self.request.set(True)
        if not code.co_filename.startswith(self.prefixes):
            return
        key = f"{code.co_filename[len(self.base):]}:{code.co_qualname}"
        in_request = self.request.get()
        if code.co_name in NOT_PLACES:
            if in_request:
                self.skipped.add(key)
            return
        place = {"place": key, "line": code.co_firstlineno, "thread": threading.current_thread().name}
        self.window.setdefault(key, place)
        if not in_request:
            return
        self.places.setdefault(key, place)
        if code.co_name == STOP[1] and code.co_filename == self.stop_file:
            self.stopped = True
            self.write()

    def write(self) -> None:
        report = {"places": list(self.places.values()), "window": list(self.window.values()),
                  "comprehensions": sorted(self.skipped), "package": self.base}
        partial = self.out.with_suffix(".part")
        partial.write_text(json.dumps(report))
        os.replace(partial, self.out)  # whole or absent: the client polls for it


def serve(out: Path, daemon_args: list[str]) -> int:
    """Run the daemon as `python -m ksi_daemon` would, every thread under the profile hook."""
    import ksi_common
    import ksi_daemon
    from ksi_daemon.__main__ import main

    dirs = [str(Path(package.__file__).resolve().parent) for package in (ksi_daemon, ksi_common)]
    trace = Trace(out, dirs)
    threading.setprofile(trace.hook)
    sys.setprofile(trace.hook)
    return main(daemon_args)


# -- the client (this process) ------------------------------------------------------------------
class Socket:
    """One connection to the daemon: a request is a line, its answer the line with its id. The
    client imports nothing of the project and spells the event names out: the same script runs
    on older commits, whose client and names module are not this one's."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer, self.sent = reader, writer, 0

    async def request(self, event: str, data: dict[str, Any]) -> Any:
        self.sent += 1
        correlation_id = f"places-{self.sent}"
        frame = {"event": event, "data": data, "correlation_id": correlation_id}
        self.writer.write(json.dumps(frame).encode() + b"\n")
        await self.writer.drain()
        while True:
            reply = json.loads(await self.reader.readline())
            if reply.get("correlation_id") != correlation_id:
                continue  # a push (an event the connection is subscribed to)
            if "error" in reply:
                raise RuntimeError(f"{event}: {reply['error']}")
            return reply["data"]

    async def turn(self, data: dict[str, Any]) -> dict[str, Any]:
        ack = await self.request("completion:async", data)
        return await self.request("completion:wait", {"request_id": ack["request_id"], "timeout": 60})


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(CLEAN_PREFIXES)}
    env.update({"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_MODE": "PRODUCTION", "LITELLM_LOG": "ERROR",
                "KSI_STORAGE": "jsonl", "PYTHONPATH": str(ROOT)})
    return env


async def connect(path: Path, process: subprocess.Popen[bytes], timeout: float = 60.0) -> Socket:
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the daemon exited with {process.returncode}")
        try:
            return Socket(*await asyncio.open_unix_connection(str(path), limit=64 * 1024 * 1024))
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError("the daemon did not open its socket") from None
            await asyncio.sleep(0.05)


async def measure(shape: str) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="ksi-places-", dir="/tmp"))
    out, sock = root / "trace.json", root / "d.sock"
    command = [sys.executable, str(Path(__file__).resolve()), "--serve", str(out), "--",
               "--quiet", "--var-dir", str(root / "var"), "--socket", str(sock)]
    stderr = open(root / "stderr.log", "w+b")  # noqa: SIM115
    process = subprocess.Popen(command, cwd=root, env=child_env(), stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        client = await connect(sock, process)
        first = await client.turn({"model": MODEL, "prompt": "warm up: a new conversation"})
        cid = first["conversation_id"]
        await client.turn({"model": MODEL, "prompt": "warm up: a continued one", "conversation_id": cid})
        await asyncio.sleep(0.5)  # what the warm-up left for later (metadata saves) runs now, untraced
        data: dict[str, Any] = {"model": MODEL, "prompt": f"{MARK}: the measured request"}
        if shape == "continue":
            data["conversation_id"] = cid
        ack = await client.request("completion:async", data)
        deadline = time.monotonic() + 30
        while not out.exists():  # nothing is sent on the socket until the trace is written
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError("the trace never reached the index append")
            await asyncio.sleep(0.02)
        result = await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 60})
        assert MARK in json.dumps(result), "the measured turn's answer does not echo its input"
        await client.request("system:shutdown", {})
        client.writer.close()
        process.wait(30)
        return json.loads(out.read_text())
    except BaseException:
        stderr.seek(0)
        print(stderr.read().decode(errors="replace")[-3000:], file=sys.stderr)
        raise
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        stderr.close()
        shutil.rmtree(root, ignore_errors=True)


# -- reporting ----------------------------------------------------------------------------------
def file_of(place: str) -> str:
    return place.rsplit(":", 1)[0]


def summary(trace: dict[str, Any], shape: str) -> dict[str, Any]:
    places = [p["place"] for p in trace["places"]]
    window = [p["place"] for p in trace["window"]]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return {"commit": commit.stdout.strip(), "shape": shape, "package": trace["package"],
            "places": len(places), "files": len({file_of(p) for p in places}),
            "window_places": len(window), "window_files": len({file_of(p) for p in window}),
            "comprehensions": len(trace["comprehensions"]),
            "python": platform.python_version(), "trace": trace}


def by_file(places: list[str]) -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = defaultdict(list)
    for place in places:
        grouped[file_of(place)].append(place.rsplit(":", 1)[1])
    return dict(sorted(grouped.items()))


def function_name(place: str) -> str:
    return place.rsplit(":", 1)[1].rsplit(".", 1)[-1]


def compare(old_path: Path, new_path: Path) -> None:
    """The places of NEW that OLD has not, by file in order of first entry; `*` marks a name OLD
    passed under another file or class (a function moved, not a hop added)."""
    old, new = (json.loads(Path(p).read_text()) for p in (old_path, new_path))
    had = [p["place"] for p in old["trace"]["places"]]
    now = [p["place"] for p in new["trace"]["places"]]
    added = [p for p in now if p not in set(had)]
    gone = [p for p in had if p not in set(now)]
    gone_names = {function_name(p) for p in gone} - {"<lambda>"}  # every lambda has that name
    moved = [p for p in added if function_name(p) in gone_names]
    print(f"{new['commit']} ({new['places']} places, {new['files']} files) against {old['commit']} "
          f"({old['places']}, {old['files']}): {len(added)} places new ({len(moved)} of them moved *), "
          f"{len(gone)} gone")
    for name, functions in by_file(added).items():
        marked = [f"{f}*" if f"{name}:{f}" in moved else f for f in functions]
        print(f"  {name} ({len(functions)}): {', '.join(marked)}")
    print("gone:")
    for name, functions in by_file(gone).items():
        print(f"  {name} ({len(functions)}): {', '.join(functions)}")


def report(result: dict[str, Any], listing: bool) -> None:
    print(f"| commit | shape | places | files | window places | window files | comprehensions |\n"
          f"|---|---|---|---|---|---|---|\n"
          f"| {result['commit']} | {result['shape']} | {result['places']} | {result['files']} "
          f"| {result['window_places']} | {result['window_files']} | {result['comprehensions']} |")
    if listing:
        for i, place in enumerate(result["trace"]["places"], 1):
            print(f"{i:4} {place['place']} (line {place['line']}, {place['thread']})")
    left_out = sorted({p["place"] for p in result["trace"]["window"]} - {p["place"] for p in result["trace"]["places"]})
    if left_out:
        print(f"in the window but not in the request's context: {', '.join(left_out)}")


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve":  # the child: argv[2] the trace file, daemon args after --
        sys.path.insert(0, str(ROOT))
        sys.exit(serve(Path(sys.argv[2]), sys.argv[4:]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=("new", "continue"), default="new")
    parser.add_argument("--list", action="store_true", help="print every place in order of first entry")
    parser.add_argument("--out", type=Path, default=ROOT / "scripts" / "bench" / "results" / "route_places.json")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("OLD", "NEW"))
    args = parser.parse_args()
    if args.compare:
        compare(*args.compare)
        return
    result = summary(asyncio.run(measure(args.shape)), args.shape)
    report(result, args.list)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
