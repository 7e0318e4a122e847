"""What the bench scripts share: a clean environment for their child processes, the local OpenAI
stub and the direct litellm baseline in processes of their own, a daemon subprocess routed to the
stub, the order of interleaved rounds, and where results are written.

The scripts import it by name (`from harness import ...`): a script run as
`.venv/bin/python scripts/bench/NAME.py` has its own folder first on sys.path. Importing it puts
the repository root on sys.path as well, for `tests.stub_openai` and `tests.pg_cluster` (the
`ksi_*` packages are installed, the tests are not).
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import uvloop

ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = Path(__file__).resolve().parent / "results"
# settings a developer's shell may carry: a bench must neither reach a real provider nor read them
CLEAN_PREFIXES = ("OPENAI_", "ANTHROPIC_", "GEMINI_", "GOOGLE_", "AZURE_", "OLLAMA_", "LITELLM_", "KSI_")
STUB_MODEL = "openai/stub-model"

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

T = TypeVar("T")


# -- environments -------------------------------------------------------------------------------
def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without CLEAN_PREFIXES, litellm offline (its bundled cost map)
    and quiet, then `extra`: the environment of a bench's child processes."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(CLEAN_PREFIXES)}
    env.update({"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_MODE": "PRODUCTION", "LITELLM_LOG": "ERROR"})
    env.update(extra)
    return env


def stub_env(**extra: str) -> dict[str, str]:
    """clean_env for the processes around the stub: litellm wants an OpenAI key before it calls an
    `openai/` model (any will do), and the children import from the repository whatever their cwd."""
    return clean_env(**{"OPENAI_API_KEY": "sk-bench-dummy", "PYTHONPATH": str(ROOT), **extra})


def stub_models(api_base: str) -> str:
    """KSI_MODELS for a daemon whose `openai/stub*` models go to the stub at `api_base`."""
    return json.dumps({"openai/stub*": {"api_base": api_base}})


def prompt(i: int) -> str:
    """The i-th user message: a different one per request, all of about the same length."""
    return f"Question {i}: what is {i} squared, and why does it matter?"


def bench_tools(count: int = 10) -> list[dict[str, Any]]:
    """`count` function tools in the Responses form (the daemon's `tools` field), each with a small
    JSON schema of its own."""
    return [{"type": "function", "name": f"tool_{k}", "description": f"Look up fact number {k} about a city.",
             "parameters": {"type": "object", "properties": {
                 "city": {"type": "string", "description": "the city"},
                 "count": {"type": "integer", "description": "how many facts"}},
                 "required": ["city"]}} for k in range(count)]


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same tools in the chat-completions form litellm takes."""
    return [{"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}} for tool in tools]


def tool_output(call_id: str, i: int) -> str:
    """What a client's tool returns for call `call_id` (the i-th turn): a short JSON text."""
    return json.dumps({"call_id": call_id, "facts": [f"fact {i}", f"fact {i + 1}"], "source": "bench"})


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, for a server that is told its port."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# -- the stub -----------------------------------------------------------------------------------
class _Discard(list):  # type: ignore[type-arg]
    """A list that keeps nothing: the stub records every request and its headers, a bench needs
    neither, and thousands of them would grow the stub's memory."""

    def append(self, _item: Any) -> None:
        pass


def serve_stub() -> None:
    """A script's `--role stub`: tests/stub_openai.py answering at once; a request that carries
    tools is answered with one call of its first tool (a tool loop never ends). Prints its
    api_base on stdout, then serves until stdin closes."""
    import itertools
    import uuid

    from aiohttp import web

    from tests.stub_openai import StubOpenAI

    calls = itertools.count(1)

    class ToolCallingStub(StubOpenAI):
        async def _chat(self, request: web.Request) -> web.StreamResponse:
            body = await request.json()
            tools = body.get("tools")
            if not tools or body.get("stream"):
                return await super()._chat(request)  # aiohttp keeps the body read above
            n = next(calls)
            name = tools[0]["function"]["name"]
            message = {"role": "assistant", "content": None, "tool_calls": [{
                "id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                "function": {"name": name, "arguments": json.dumps({"city": f"City {n}", "count": 2})}}]}
            prompt_tokens = self.prompt_tokens(body.get("messages", []))
            return web.json_response({
                "id": f"chatcmpl-{uuid.uuid4().hex[:10]}", "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model", "stub"),
                "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 12, "total_tokens": prompt_tokens + 12}})

    async def main() -> None:
        async with ToolCallingStub() as server:
            server.requests = _Discard()
            server.headers = _Discard()
            print(server.api_base, flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)

    asyncio.run(main())


class StubProcess:
    """`script --role stub` (see serve_stub) as a child process, so that the stub's CPU is never
    counted with anything measured; it answers at `api_base` until stop()."""

    def __init__(self, script: str | Path) -> None:
        self.process = subprocess.Popen([sys.executable, str(script), "--role", "stub"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, env=stub_env(), cwd=ROOT)
        assert self.process.stdout is not None
        self.api_base = self.process.stdout.readline().strip()
        if not self.api_base.startswith("http"):
            self.stop()
            raise RuntimeError("the stub did not start")

    def stop(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(10)


# -- the direct litellm baseline ----------------------------------------------------------------
def quiet_litellm() -> Any:
    """litellm imported for a process that calls it itself, set like the daemons' (clean_env):
    bundled cost map, production mode, errors only; no debug banner, tokenizer download or telemetry."""
    for name, value in (("LITELLM_LOCAL_MODEL_COST_MAP", "True"), ("LITELLM_MODE", "PRODUCTION"),
                        ("LITELLM_LOG", "ERROR")):
        os.environ.setdefault(name, value)
    import litellm

    litellm.suppress_debug_info = True
    litellm.disable_hf_tokenizer_download = True
    litellm.telemetry = False
    return litellm


def serve_batches(batch: Callable[[str, int, int], Awaitable[dict[str, Any]]]) -> None:
    """The worker's side of DirectWorker: every `SHAPE COUNT OFFSET` line on stdin is answered with
    batch(shape, count, offset) as one JSON line, until stdin closes."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            shape, count, offset = line.split()
            print(json.dumps(await batch(shape, int(count), int(offset))), flush=True)

    # the daemon's event loop: litellm's own CPU is measured on the loop it runs on in the daemon
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())


class DirectWorker:
    """`script --role direct ROLE_ARGS`, the baseline that calls litellm itself, in a process of its
    own so that its CPU is its own; batch() asks it for one batch (see serve_batches)."""

    def __init__(self, script: str | Path, *role_args: str) -> None:
        self.process = subprocess.Popen([sys.executable, str(script), "--role", "direct", *role_args],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=stub_env(),
                                        cwd=tempfile.gettempdir())

    def batch(self, shape: str, count: int, offset: int) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(f"{shape} {count} {offset}\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError("the direct worker died")
        return json.loads(line)

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(30)


# -- CPU time of another process -----------------------------------------------------------------
def process_cpu_s(process: Any) -> float:
    """User + system CPU seconds of a psutil `process` so far, its exited threads included.

    On Linux from the process's own CPU clock (the clock id clock_getcpuclockid(3) makes), to the
    nanosecond: the user and system times of /proc count 10 ms ticks, which for a batch of a few
    hundred sub-millisecond requests is a step of tens of microseconds per request."""
    if sys.platform.startswith("linux"):
        try:
            return time.clock_gettime(((~process.pid) << 3) | 2)  # CPUCLOCK_SCHED, whole process
        except OSError:
            pass  # not ours to read: psutil's ticks below
    times = process.cpu_times()
    return float(times.user + times.system)


def postgres_cpu_s(cluster: Any) -> float:
    """CPU seconds of a PostgreSQL server (a tests.pg_cluster.ThrowawayCluster, or None: 0) so
    far: every process alive now, each by its own CPU clock, plus what its exited processes
    (backends, autovacuum workers) used, which the postmaster counts as its children's (in ticks)."""
    if cluster is None:
        return 0.0
    import psutil

    postmaster = psutil.Process(int((cluster.data / "postmaster.pid").read_text().split()[0]))
    reaped = postmaster.cpu_times()
    total = float(reaped.children_user + reaped.children_system)
    for process in (postmaster, *postmaster.children(recursive=True)):
        try:
            total += process_cpu_s(process)
        except psutil.NoSuchProcess:  # a backend that ended meanwhile: counted with the children
            continue
    return total


# -- a daemon on the stub -----------------------------------------------------------------------
class Daemon:
    """`python -m ksi_daemon --quiet ... ARGS` as a subprocess, its `openai/stub*` models (STUB_MODEL
    by default) going to the stub at `api_base`, `env` added to stub_env. `launcher` stands for
    `python -m ksi_daemon` when a wrapper taking the same arguments runs the daemon instead.

    Its var dir is made in `workdir`, its socket under /tmp (a socket path has a length limit);
    its stderr is kept in a file and shown if it exits before answering. stop() leaves the var dir
    to the caller: when thousands of files are deleted can change what the next daemon measures."""

    def __init__(self, api_base: str, workdir: Path, env: dict[str, str] | None = None,
                 args: Sequence[str] = (), launcher: Sequence[str] = ()) -> None:
        import psutil

        self.root = Path(tempfile.mkdtemp(prefix="ksi-daemon-", dir="/tmp"))
        self.var_dir = Path(tempfile.mkdtemp(prefix="var-", dir=workdir))
        self.socket = self.root / "d.sock"
        self.clients: list[Any] = []
        command = [*(launcher or (sys.executable, "-m", "ksi_daemon")), "--quiet",
                   "--var-dir", str(self.var_dir), "--socket", str(self.socket), *args]
        full_env = stub_env(KSI_MODELS=stub_models(api_base), KSI_DEFAULT_MODEL=STUB_MODEL, **(env or {}))
        self.stderr = open(self.root / "stderr.log", "w+b")  # noqa: SIM115
        self.process = subprocess.Popen(command, cwd=self.root, env=full_env, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=self.stderr)
        self.ps = psutil.Process(self.process.pid)

    @property
    def client(self) -> Any:
        """The first connection, the one connect() waited on."""
        return self.clients[0]

    def cpu_s(self) -> float:
        """CPU seconds the daemon has used so far, all its threads (see process_cpu_s)."""
        return process_cpu_s(self.ps)

    async def connect(self, connections: int = 1, timeout: float = 120.0) -> None:
        """Wait until the daemon answers system:health, then hold `connections` connections to it."""
        from ksi_common.client import KsiClient
        from ksi_common.errors import KsiError

        deadline = time.monotonic() + timeout
        while not self.clients:
            if self.process.poll() is not None:
                self.stderr.seek(0)
                raise RuntimeError(f"daemon exited: {self.stderr.read().decode(errors='replace')[-2000:]}")
            try:
                client = await KsiClient(self.socket).connect()
                await client.request("system:health")
                self.clients.append(client)
            except (KsiError, OSError):
                if time.monotonic() > deadline:
                    raise RuntimeError("the daemon did not answer") from None
                await asyncio.sleep(0.05)
        for _ in range(connections - 1):
            self.clients.append(await KsiClient(self.socket).connect())

    async def stop(self) -> None:
        """system:shutdown (terminate if it cannot be asked), killed after 30 s; its socket dir removed."""
        for client in self.clients[1:]:
            await client.close()
        if self.clients:
            try:
                await self.clients[0].request("system:shutdown")
            except Exception:
                self.process.terminate()
            await self.clients[0].close()
        elif self.process.poll() is None:
            self.process.terminate()
        try:
            await asyncio.to_thread(self.process.wait, 30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.stderr.close()
        shutil.rmtree(self.root, ignore_errors=True)


# -- rounds and results -------------------------------------------------------------------------
def rotated(items: Sequence[T], round_no: int) -> list[T]:
    """`items` in round `round_no`'s order: interleaved rounds rotate who goes first, so drift and
    noise from other work on the machine fall on every player alike."""
    at = round_no % len(items)
    return [*items[at:], *items[:at]]


def machine(**extra: Any) -> dict[str, Any]:
    """What a report says about the machine it ran on: Python, CPUs, platform, then `extra`."""
    return {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform(), **extra}


def write_results(name: str, report: Any) -> None:
    """`report` as JSON in scripts/bench/results/NAME.json (gitignored), and a line saying so."""
    path = RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {path.relative_to(ROOT)}")
