"""Crash safety: SIGKILL a subprocess daemon at random moments while completions run, restart it,
and check that nothing acknowledged is lost, nothing torn breaks a reader and nothing is half-indexed.

The harness (`crash_rounds`) is shared with scripts/bench/crash_rounds.py, which runs it longer.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest

from ksi_common import doctor
from ksi_common.client import KsiClient
from ksi_common.errors import KsiError
from ksi_common.jsonl import read_records
from ksi_common.layout import VarLayout
from ksi_common.reading import open_reader
from ksi_common.records import read_index, read_response
from ksi_daemon.services.completion.recovery import recover
from ksi_daemon.storage.jsonl.conversations import JsonlConversations
from ksi_daemon.storage.jsonl.files import append_lines
from ksi_daemon.storage.jsonl.journal import JsonlJournal
from ksi_daemon.storage.jsonl.responses import JsonlResponses
from tests.stub_openai import StubOpenAI

pytestmark = pytest.mark.backends

REPO = Path(__file__).resolve().parent.parent
CLEAN_PREFIXES = ("OPENAI_", "ANTHROPIC_", "GEMINI_", "GOOGLE_", "AZURE_", "OLLAMA_", "LITELLM_", "KSI_")


class SlowStub(StubOpenAI):
    """The stub with a random delay per answer, so kills land while calls are in flight."""

    def __init__(self, rng: random.Random, low: float, high: float) -> None:
        super().__init__()
        self.rng, self.low, self.high = rng, low, high

    async def _chat(self, request: Any) -> Any:
        await asyncio.sleep(self.rng.uniform(self.low, self.high))
        return await super()._chat(request)


def daemon_env(api_base: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(CLEAN_PREFIXES)}
    env.update({
        "KSI_MODELS": json.dumps({"openai/stub*": {"api_base": api_base}}),
        "KSI_DEFAULT_MODEL": "openai/stub-model",
        "OPENAI_API_KEY": "dummy",
        "KSI_LITELLM_PRELOAD": "true",
        "KSI_RETRY_BASE_DELAY": "0.01",
        "KSI_RETRY_MAX_DELAY": "0.05",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_MODE": "PRODUCTION",
        "PYTHONPATH": str(REPO),
    })
    env.update(extra)
    return env


class DaemonProcess:
    """A daemon in a subprocess on `root/var` and `root/d.sock`."""

    def __init__(self, root: Path, env: dict[str, str]) -> None:
        self.root = root
        self.var = root / "var"
        self.socket = root / "d.sock"
        self.env = env
        self.process: subprocess.Popen[bytes] | None = None

    async def start(self, wait: float = 30.0, litellm: bool = True) -> None:
        """Spawn the daemon; return once it answers (and, with `litellm`, once litellm is loaded:
        its import holds the GIL for seconds, so kills before it would all land in one phase)."""
        with open(self.root / "stderr.log", "ab") as stderr:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "ksi_daemon", "--quiet", "--var-dir", str(self.var),
                 "--socket", str(self.socket)],
                cwd=self.root, env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=stderr,
            )
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.process.returncode}: "
                                   + (self.root / "stderr.log").read_text()[-2000:])
            try:
                async with KsiClient(self.socket) as client:
                    health = await asyncio.wait_for(client.request("system:health"), 2.0)
                    if health.get("litellm_loaded") or not litellm:
                        return
                    await asyncio.sleep(0.05)
            except (KsiError, TimeoutError):
                await asyncio.sleep(0.02)
        raise RuntimeError("daemon did not answer")

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def kill_if_running(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.kill()

    async def stop(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        for _ in range(500):
            if self.process.poll() is not None:
                return
            await asyncio.sleep(0.02)
        self.kill()


@dataclass
class Ledger:
    """What the client was told: acks, delivered results, failures, per request id."""

    acked: dict[str, str] = field(default_factory=dict)  # request_id -> conversation_id
    prompts: dict[str, str] = field(default_factory=dict)  # request_id -> prompt
    delivered: dict[str, dict[str, Any]] = field(default_factory=dict)  # request_id -> result data
    failed: dict[str, str] = field(default_factory=dict)  # request_id -> error code
    recovered_failed: set[str] = field(default_factory=set)  # daemon_restart after a kill
    recovered_done: set[str] = field(default_factory=set)  # indexed just before a kill
    lost: list[str] = field(default_factory=list)  # acknowledged exchanges missing (must stay empty)
    warmups: int = 0

    def open(self) -> list[str]:
        settled = self.delivered.keys() | self.failed.keys() | self.recovered_failed | self.recovered_done
        return [r for r in self.acked if r not in settled]


async def indexed_requests(var: Path, database_url: str | None = None) -> dict[str, tuple[str, str, str]]:
    """request_id -> (conversation_id, response_id, content) for every indexed exchange, read
    through the read port of the backend (files, or the database when a URL is given)."""
    reader = open_reader("postgres" if database_url else "jsonl", VarLayout(var), database_url)
    found: dict[str, tuple[str, str, str]] = {}
    try:
        for conversation_id in await reader.conversation_ids():
            entries = await reader.entries(conversation_id)
            assert [e.n for e in entries] == list(range(1, len(entries) + 1)), f"{conversation_id}: numbering broken"
            records = await reader.responses([e.response_id for e in entries])
            for entry, record in zip(entries, records, strict=True):
                assert record is not None and record.ok, f"{conversation_id}: {entry.response_id} dangling"
                request_id = str(record.outcome["request_id"])  # type: ignore[index]
                assert request_id not in found, f"{request_id} indexed twice"
                found[request_id] = (conversation_id, entry.response_id, record.content)
    finally:
        await reader.aclose()
    return found


async def check_stored(var: Path, ledger: Ledger, database_url: str | None = None) -> dict[str, tuple[str, str, str]]:
    """With the daemon dead: everything stored reads, every index entry resolves, nothing acked is lost."""
    if database_url is None:  # files: whatever a kill left reads, and the doctor finds only torn tails
        layout = VarLayout(var)
        report = doctor.check(var)
        unexpected = [p for p in report.problems if p.kind not in ("torn_tail", "stale_pid", "stale_socket")]
        assert not unexpected, unexpected
        for path in layout.responses_dir.glob("*.jsonl"):
            read_response(path)  # never raises, whatever a kill left
        read_records(layout.requests_file)
    indexed = await indexed_requests(var, database_url)
    for request_id, result in ledger.delivered.items():
        where = indexed.get(request_id)
        if where is None or where[1] != result["response_id"] or where[2] != result["content"]:
            ledger.lost.append(request_id)
    return indexed


async def settle_after_restart(daemon: DaemonProcess, ledger: Ledger, database_url: str | None) -> None:
    """Requests open at the kill: failed with daemon_restart and not indexed, or done and indexed
    (as the restarted daemon stores them: with fsync on, it first writes again the exchanges whose
    log record was synced before the kill and whose files were not yet written)."""
    indexed = await indexed_requests(daemon.var, database_url)
    async with KsiClient(daemon.socket) as client:
        for request_id in ledger.open():
            frame = await client.send_frame("completion:status", {"request_id": request_id})
            if "error" in frame:
                # finished (journaled done) an instant before the kill, its result still in a
                # buffer: the restarted daemon no longer knows it, but the exchange must be indexed
                assert frame["error"]["code"] == "request_not_found", frame
                assert request_id in indexed, f"{request_id} unknown after restart and not indexed"
                ledger.recovered_done.add(request_id)
                continue
            status = frame["data"]
            if status["status"] == "done":
                if request_id not in indexed:  # PostgreSQL: run again by the restarted daemon since that read
                    indexed = await indexed_requests(daemon.var, database_url)
                assert request_id in indexed, f"{request_id} reported done but not indexed"
                result = await client.request("completion:wait", {"request_id": request_id, "timeout": 0})
                assert result["response_id"] == indexed[request_id][1]
                assert result["content"] == indexed[request_id][2]
                ledger.recovered_done.add(request_id)
                continue
            if status["status"] in ("queued", "running"):
                # PostgreSQL: accepted is durable for the pool, so the restarted daemon (another
                # member to the database) takes the dead one's request over and runs it again
                assert database_url is not None, status
                result = await client.request("completion:wait", {"request_id": request_id, "timeout": 60})
                indexed = await indexed_requests(daemon.var, database_url)
                assert request_id in indexed and result["response_id"] == indexed[request_id][1], result
                ledger.recovered_done.add(request_id)
                continue
            assert status["status"] == "failed" and status["reason"] == "daemon_restart", status
            assert request_id not in indexed, f"{request_id} failed with daemon_restart yet is indexed"
            frame = await client.send_frame("completion:wait", {"request_id": request_id, "timeout": 0})
            assert frame["error"]["code"] == "daemon_restart", frame
            ledger.recovered_failed.add(request_id)


async def drive(daemon: DaemonProcess, ledger: Ledger, queue: list[tuple[str, str]], quota: int,
                rng: random.Random, kill_after: float | None) -> None:
    """Send prompts from `queue` until `quota` are acked; SIGKILL after `kill_after` seconds."""
    async with KsiClient(daemon.socket) as sender, KsiClient(daemon.socket) as watcher, \
            KsiClient(daemon.socket) as waiter:
        await watcher.request("monitor:subscribe", {"patterns": ["completion:result", "completion:error"]})

        async def watch() -> None:
            async for frame in watcher.pushes():
                data = frame["data"]
                if frame["event"] == "completion:result":
                    ledger.delivered[data["request_id"]] = data
                else:
                    ledger.failed[data["request_id"]] = data["code"]

        async def wait_for(request_id: str) -> None:
            try:
                result = await waiter.request("completion:wait", {"request_id": request_id, "timeout": 60})
            except KsiError as error:
                if error.code != "daemon_unreachable":
                    ledger.failed[request_id] = error.code
                return
            except ConnectionError:  # killed while the request was being written
                return
            if "content" in result:
                ledger.delivered[request_id] = result

        async def send() -> None:
            sent = 0
            while queue and sent < quota:
                conversation_id, prompt = queue[0]
                ack = await sender.request("completion:async", {
                    "prompt": prompt, "conversation_id": conversation_id, "create": True})
                queue.pop(0)
                sent += 1
                ledger.acked[ack["request_id"]] = conversation_id
                ledger.prompts[ack["request_id"]] = prompt
                waiters.append(asyncio.create_task(wait_for(ack["request_id"])))
                await asyncio.sleep(rng.uniform(0, 0.01))

        waiters: list[asyncio.Task[None]] = []
        watching = asyncio.create_task(watch())
        sending = asyncio.create_task(send())
        try:
            if kill_after is None:
                await sending
                await asyncio.gather(*waiters)
                await asyncio.sleep(0.1)  # let the last pushes arrive
            else:
                await asyncio.sleep(kill_after)
                daemon.kill()
                # every frame the daemon wrote before dying is still read, up to the end of file
                await asyncio.gather(sending, watching, *waiters, return_exceptions=True)
        finally:
            await asyncio.gather(*waiters, return_exceptions=True)  # those started meanwhile too
            sending.cancel()
            watching.cancel()
            await asyncio.gather(sending, watching, return_exceptions=True)


async def warm_up(daemon: DaemonProcess, ledger: Ledger) -> None:
    """One completion first: the first provider call of a process pays seconds of lazy imports
    (holding the GIL), and kills should land in steady traffic, not all in that phase."""
    async with KsiClient(daemon.socket) as client:
        ack = await client.request("completion:async", {"prompt": "warm up", "conversation_id": "warmup",
                                                        "create": True})
        ledger.acked[ack["request_id"]] = "warmup"
        ledger.warmups += 1
        ledger.delivered[ack["request_id"]] = await client.request(
            "completion:wait", {"request_id": ack["request_id"], "timeout": 60})


async def crash_rounds(root: Path, *, rounds: int = 4, total: int = 200, conversations: int = 20,
                       seed: int | None = None, log: Callable[[str], None] = lambda _m: None,
                       extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `rounds` kill/restart rounds over `total` completions; returns the counts."""
    seed = random.randrange(1 << 30) if seed is None else seed
    rng = random.Random(seed)
    database_url = (extra_env or {}).get("KSI_DATABASE_URL") if (extra_env or {}).get("KSI_STORAGE") == "postgres" else None
    ledger = Ledger()
    per_conversation = -(-total // conversations)
    queue = [(f"conv{c:02d}", f"conv{c:02d} prompt {k}")
             for k in range(per_conversation) for c in range(conversations)][:total]
    started = time.perf_counter()
    survived = 0
    indexed: dict[str, tuple[str, str, str]] = {}
    async with SlowStub(rng, 0.005, 0.08) as stub:
        daemon = DaemonProcess(root, daemon_env(stub.api_base, **(extra_env or {})))
        try:
            for number in range(1, rounds + 1):
                await daemon.start()
                if number > 1:
                    await settle_after_restart(daemon, ledger, database_url)
                await warm_up(daemon, ledger)
                quota = -(-len(queue) // (rounds - number + 2))
                kill_after = rng.uniform(0.05, 1.0)
                await drive(daemon, ledger, queue, quota, rng, kill_after)
                indexed = await check_stored(daemon.var, ledger, database_url)  # acked exchanges are in files already
                survived += 1
                log(f"round {number}: killed after {kill_after:.2f}s; acked {len(ledger.acked)}, "
                    f"delivered {len(ledger.delivered)}, indexed {len(indexed)}, lost {len(ledger.lost)}")
            await daemon.start()
            await settle_after_restart(daemon, ledger, database_url)
            await drive(daemon, ledger, queue, len(queue), rng, None)
            # the conversations go on after the crashes: one more exchange in each
            async with KsiClient(daemon.socket) as client:
                for c in range(conversations):
                    ack = await client.request("completion:async", {"prompt": "after the crashes",
                                                                    "conversation_id": f"conv{c:02d}"})
                    result = await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 30})
                    ledger.acked[ack["request_id"]] = f"conv{c:02d}"
                    ledger.delivered[ack["request_id"]] = result
            await daemon.stop()
        finally:  # a round that failed leaves no daemon running
            daemon.kill_if_running()
    final = await check_stored(daemon.var, ledger, database_url)
    done = ledger.delivered.keys() | ledger.recovered_done
    failed = ledger.recovered_failed | ledger.failed.keys()
    return {
        "seed": seed,
        "rounds_survived": survived,
        "acked": len(ledger.acked),
        "warmups": ledger.warmups,
        "delivered": len(ledger.delivered),
        "recovered_done": len(ledger.recovered_done),
        "failed_daemon_restart": len(ledger.recovered_failed),
        "failed_other": {r: c for r, c in ledger.failed.items()},
        "open": ledger.open(),
        "indexed": len(final),
        # accepted (durable for the pool on PostgreSQL) but killed before its ack reached the
        # client: run by the restarted daemon, stored once, never told to anyone
        "run_unacked": sorted(set(final) - ledger.acked.keys()),
        "indexed_not_done": sorted((set(final) & ledger.acked.keys()) - done),
        "done_not_indexed": sorted(done - set(final)),
        "failed_but_indexed": sorted(failed & set(final)),
        "lost": ledger.lost,
        "seconds": round(time.perf_counter() - started, 1),
    }


async def test_sigkill_rounds_lose_nothing_acknowledged(short_tmp: Path, backend: dict[str, Any]) -> None:
    # the database run is shorter: the same specification, without doubling the suite's slowest test
    rounds, total, conversations = (3, 200, 20) if not backend else (1, 60, 10)
    extra = {"KSI_STORAGE": "postgres", "KSI_DATABASE_URL": backend["database_url"]} if backend else {}
    outcome = await crash_rounds(short_tmp, rounds=rounds, total=total, conversations=conversations, log=print,
                                 extra_env=extra)
    print(outcome)
    assert outcome["rounds_survived"] == rounds
    assert outcome["lost"] == []
    assert outcome["acked"] == total + conversations + outcome["warmups"]  # under fire, then one more each
    assert outcome["open"] == []
    assert outcome["failed_other"] == {}
    assert outcome["indexed_not_done"] == [] and outcome["done_not_indexed"] == []
    assert outcome["failed_but_indexed"] == []
    assert outcome["indexed"] == outcome["delivered"] + outcome["recovered_done"] + len(outcome["run_unacked"])
    assert len(outcome["run_unacked"]) <= rounds  # at most the one in flight at each kill


# -- unit level: the primitives the crash safety rests on -----------------------------


def test_append_repairs_a_torn_tail(tmp_path: Path) -> None:
    path = tmp_path / "index.jsonl"
    append_lines(path, b'{"n": 1}\n{"n": 2}\n', fsync=True)
    with open(path, "ab") as handle:
        handle.write(b'{"n": 3, "response_id": "cut-by-a-cr')  # a crash mid-line
    assert read_records(path) == [{"n": 1}, {"n": 2}]  # readers skip the torn line
    append_lines(path, b'{"n": 3}\n', fsync=False)
    assert path.read_bytes() == b'{"n": 1}\n{"n": 2}\n{"n": 3}\n'


def test_append_repairs_a_torn_tail_longer_than_a_block(tmp_path: Path) -> None:
    path = tmp_path / "index.jsonl"
    path.write_bytes(b'{"n": 1}\n' + b"x" * 10_000)
    append_lines(path, b'{"n": 2}\n', fsync=False)
    assert path.read_bytes() == b'{"n": 1}\n{"n": 2}\n'
    lone = tmp_path / "lone.jsonl"
    lone.write_bytes(b"torn without any newline")
    append_lines(lone, b'{"n": 1}\n', fsync=False)
    assert lone.read_bytes() == b'{"n": 1}\n'


def test_complete_line_without_newline_counts_as_torn(tmp_path: Path) -> None:
    # a kill between the JSON and its newline: readers and the writer agree it is not there
    path = tmp_path / "index.jsonl"
    path.write_bytes(b'{"v": 1, "n": 1, "response_id": "a"}\n{"v": 1, "n": 2, "response_id": "b"}')
    assert [e.response_id for e in read_index(path)] == ["a"]
    append_lines(path, b'{"v": 1, "n": 2, "response_id": "c"}\n', fsync=False)
    assert [e.response_id for e in read_index(path)] == ["a", "c"]


def _journal(tmp_path: Path, lines: list[dict[str, Any]]) -> JsonlJournal:
    layout = VarLayout(tmp_path)
    layout.state_dir.mkdir(parents=True, exist_ok=True)
    layout.conversations_dir.mkdir(parents=True, exist_ok=True)
    layout.responses_dir.mkdir(parents=True, exist_ok=True)
    layout.requests_file.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines) + b'{"request_id": "torn')
    return JsonlJournal(layout)


async def _recover(tmp_path: Path, journal: JsonlJournal) -> list[dict[str, Any]]:
    layout = VarLayout(tmp_path)
    return await recover(journal, JsonlConversations(layout, fsync=False), JsonlResponses(layout, fsync=False))


async def test_journal_reports_unfinished_requests_as_daemon_restart(tmp_path: Path) -> None:
    journal = _journal(tmp_path, [
        {"request_id": "r1", "conversation_id": "c", "status": "queued", "response_id": "m-0"},  # never indexed
        {"request_id": "r2", "conversation_id": "c", "status": "queued"},
        {"request_id": "r2", "conversation_id": "c", "status": "running", "response_id": "m-1"},
        {"request_id": "r3", "conversation_id": "c", "status": "queued"},
        {"request_id": "r3", "conversation_id": "c", "status": "done"},
    ])
    recovered = {r["request_id"]: r for r in await _recover(tmp_path, journal)}
    assert set(recovered) == {"r1", "r2", "r3"}  # the finished one is kept, for completion:status
    assert recovered["r3"]["status"] == "done"
    assert all(recovered[r]["status"] == "failed" and recovered[r]["code"] == "daemon_restart" for r in ("r1", "r2"))
    # a second restart still knows them, and the torn line is gone
    assert {r["request_id"]: r["status"] for r in await _recover(tmp_path, journal)} == {"r1": "failed", "r2": "failed", "r3": "done"}
    assert not journal.path.read_bytes().endswith(b"torn")


@pytest.mark.parametrize("lines", [
    # what the daemon journals: the response id comes with `queued`
    [{"request_id": "r1", "conversation_id": "c", "status": "queued", "response_id": "m-1"}],
    # a journal of an earlier version: the response id came with a `running` line
    [{"request_id": "r1", "conversation_id": "c", "status": "queued"},
     {"request_id": "r1", "conversation_id": "c", "status": "running", "response_id": "m-1"}],
], ids=["queued-with-response-id", "legacy-running-line"])
async def test_journal_recovers_a_request_indexed_just_before_the_kill(tmp_path: Path,
                                                                      lines: list[dict[str, Any]]) -> None:
    # killed after the index line was appended but before the journal said `done`:
    # the exchange is in the history, so the request is done, not failed (a retry would duplicate it)
    journal = _journal(tmp_path, lines)
    layout = VarLayout(tmp_path)
    layout.response_file("m-1").write_bytes(
        orjson.dumps({"v": 1, "type": "user", "content": "hi"}) + b"\n"
        + orjson.dumps({"v": 1, "type": "assistant", "content": "hello", "model": "openai/stub-model",
                        "request_id": "r1", "conversation_id": "c", "usage": {}, "finish_reason": "stop"})
        + b"\n")
    layout.index_file("c").write_bytes(orjson.dumps({"v": 1, "n": 1, "response_id": "m-1"}) + b"\n")
    (record,) = await _recover(tmp_path, journal)
    assert record["status"] == "done" and record["response_id"] == "m-1"
    assert record["result"]["content"] == "hello" and record["result"]["exchange"] == 1
    (again,) = await _recover(tmp_path, journal)
    assert again["status"] == "done"
