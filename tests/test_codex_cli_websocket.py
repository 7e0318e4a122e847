"""The real Codex CLI over KSI's Responses WebSocket mode (`supports_websockets = true`): `codex exec`
running a shell command, then two `codex exec resume --last`. One KSI conversation holds every turn,
every tool call and output is replayed to the provider on the later turns, nothing is refused, and
Codex never falls back to HTTP: a byte-counting proxy between Codex and the daemon sees WebSocket
handshakes on /v1/responses and no POST to it. Then Codex's remote compaction (its provider named
"OpenAI", its auto-compact limit small) over the same socket: each is answered by KSI's compaction
item, no model is called for it, and the session goes on in the same conversation."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import HttpDaemon, connected
from tests.stored import stored_index
from tests.stub_openai import Reply, StubOpenAI
from tests.test_codex_cli import (
    calls_and_outputs,
    codex_bin,
    codex_config,
    conversations,
    exec_and_two_resumes,
    http,
    run_codex,
    shell_call,
)

__all__ = ["codex_bin", "http"]  # fixtures shared with the HTTP test

pytestmark = pytest.mark.backends

MODEL = "openai/stub-codex"


@dataclass
class CountingProxy:
    """Forwards loopback TCP to the daemon and keeps what clients sent, to count request lines.
    A WebSocket client masks its frames, so a request line seen here is a real HTTP request."""

    target_port: int
    sent: list[bytearray] = field(default_factory=list)  # per connection, growing as its client sends
    port: int = 0

    def count(self, line: bytes) -> int:
        return sum(stream.count(line) for stream in self.sent)

    def handshakes(self) -> int:
        return sum(1 for stream in self.sent
                   if b"GET /v1/responses HTTP/1.1" in stream and b"upgrade: websocket" in stream.lower())

    async def serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        daemon_reader, daemon_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        stream = bytearray()
        self.sent.append(stream)

        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, keep: bytearray | None) -> None:
            try:
                while chunk := await reader.read(65536):
                    if keep is not None:
                        keep.extend(chunk)
                    writer.write(chunk)
                    await writer.drain()
            except ConnectionError:
                pass
            finally:
                writer.close()

        await asyncio.gather(pipe(client_reader, daemon_writer, stream), pipe(daemon_reader, client_writer, None))


@pytest.fixture
async def proxy(http: HttpDaemon) -> AsyncIterator[CountingProxy]:
    counting = CountingProxy(int(http.base_url.rsplit(":", 1)[1]))
    server = await asyncio.start_server(counting.serve, "127.0.0.1", 0)
    counting.port = server.sockets[0].getsockname()[1]
    async with server:
        yield counting


def websocket_config(http: HttpDaemon, proxy: CountingProxy) -> str:
    """docs/codex.md's config with the WebSocket mode on, through the counting proxy."""
    config = codex_config(http, MODEL).replace("supports_websockets = false", "supports_websockets = true")
    return config.replace(http.base_url, f"http://127.0.0.1:{proxy.port}")


async def test_codex_over_the_websocket_keeps_one_conversation_and_never_falls_back_to_http(
        codex_bin: Path, http: HttpDaemon, proxy: CountingProxy, stub: StubOpenAI, tmp_path: Path) -> None:
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (home / "config.toml").write_text(websocket_config(http, proxy))

    await exec_and_two_resumes(codex_bin, home, work, http.token, stub, False)

    assert proxy.handshakes() >= 3  # one socket per `codex exec` at least
    assert proxy.count(b"POST /v1/responses") == 0  # no fallback to HTTP
    assert len(stub.requests) == 5  # call, answer; call, answer; answer: nothing refused, nothing retried
    calls, outputs = calls_and_outputs(stub, False, -1)
    assert calls == ["call_one", "call_two"]  # every call replayed on the last turn
    assert "ksi-marker-one" in outputs["call_one"] and "ksi-marker-two" in outputs["call_two"]
    calls, outputs = calls_and_outputs(stub, False, 2)
    assert calls == ["call_one"] and "ksi-marker-one" in outputs["call_one"]

    async with connected(http.daemon) as client:
        [conversation] = await conversations(client)
    assert len(await stored_index(http.daemon, conversation)) == 5


def compacting_config(http: HttpDaemon, proxy: CountingProxy, limit: int) -> str:
    """The WebSocket config under the name that makes Codex compact remotely (through KSI), with
    Codex's own auto-compact limit small enough for a short session to cross it."""
    config = websocket_config(http, proxy).replace('name = "KSI"', 'name = "OpenAI"')
    return f"model_auto_compact_token_limit = {limit}\n" + config


async def test_codex_compaction_over_the_websocket_is_answered_by_ksi_and_the_session_goes_on(
        codex_bin: Path, http: HttpDaemon, proxy: CountingProxy, stub: StubOpenAI, tmp_path: Path) -> None:
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (home / "config.toml").write_text(compacting_config(http, proxy, 100))

    stub.enqueue(shell_call("call_one", "ksi-marker-one", False), Reply(text="Ran the first command."))
    said = [await run_codex(codex_bin, home, work, http.token, "--skip-git-repo-check", "-s", "danger-full-access",
                            "Run the first command")]
    for question, answer in (("Are you still there?", "Still here."), ("And now?", "Yes, still here.")):
        stub.enqueue(Reply(text=answer))
        said.append(await run_codex(codex_bin, home, work, http.token, "resume", "--last", "--skip-git-repo-check",
                                    question))
        assert answer in said[-1]  # the session goes on after each compaction

    assert all("context compacted" in output for output in said)
    async with connected(http.daemon) as client:
        [conversation] = await conversations(client)
    checkpoints = compaction_items(home)
    assert len(checkpoints) == 3 and all(item["format"] == "ksi-compaction/1" for item in checkpoints)
    assert {item["conversation_id"] for item in checkpoints} == {conversation}
    assert len(stub.requests) == 4  # compacting called no model
    calls, outputs = calls_and_outputs(stub, False, -1)
    assert calls == ["call_one"] and "ksi-marker-one" in outputs["call_one"]  # the history survives compaction
    assert proxy.handshakes() >= 3 and proxy.count(b"POST /v1/responses") == 0  # compacted over the socket too
    assert len(await stored_index(http.daemon, conversation)) == 4


def compaction_items(home: Path) -> list[dict[str, Any]]:
    """The checkpoints in the histories Codex replaced its own with (its session file): the
    `compaction` items KSI answered with."""
    [session] = (home / "sessions").rglob("*.jsonl")
    found: list[dict[str, Any]] = []
    for line in session.read_text().splitlines():
        record = json.loads(line)
        if record.get("type") == "compacted":  # the history Codex goes on from, checkpoint included
            found.extend(json.loads(item["encrypted_content"]) for item in record["payload"]["replacement_history"]
                         if item["type"] == "compaction")
    return found
