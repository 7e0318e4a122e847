"""One descriptor budget for every door: idle and slow HTTP connections (no token needed to open
them) can neither exhaust the daemon's descriptors nor crowd out the Unix socket; an HTTP
connection past the budget is answered in the daemon's error shape and closed; a request head
that does not arrive in time, and an idle kept-alive connection, are closed."""

from __future__ import annotations

import asyncio
import resource
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any

import orjson

from ksi_common.client import KsiClient
from ksi_common.errors import KsiError
from ksi_daemon.transports.budget import ConnectionBudget
from tests.conftest import HTTP_TOKEN, complete, connected, running_http_daemon
from tests.test_cli_ask import clean_env

SLOW_HEAD = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n"  # the blank line that ends it never comes


async def http_connection(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return await asyncio.open_connection(host, int(port))


async def everything_until_closed(reader: asyncio.StreamReader, wait: float = 60.0) -> bytes:
    try:
        return await asyncio.wait_for(reader.read(), wait)
    except ConnectionResetError:
        return b"<reset>"


def parse_response(raw: bytes) -> tuple[int, dict[str, str], Any]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode().split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, orjson.loads(body) if body else None


async def models_over_http(url: str) -> tuple[int, dict[str, str], Any]:
    reader, writer = await http_connection(url)
    writer.write(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Authorization: Bearer " + HTTP_TOKEN.encode() + b"\r\nConnection: close\r\n\r\n")
    try:
        return parse_response(await everything_until_closed(reader))
    finally:
        writer.close()


async def test_http_and_unix_connections_share_one_cap(short_tmp: Path) -> None:
    async with running_http_daemon(short_tmp, max_connections=3, http_head_timeout=600) as http:
        unix = [await KsiClient(http.daemon.settings.socket).connect() for _ in range(2)]
        _idle_reader, idle = await http_connection(http.base_url)  # the third: HTTP, no byte sent
        while http.daemon.connection_budget.held < 3:
            await asyncio.sleep(0.01)
        status, headers, body = await models_over_http(http.base_url)
        assert status == 503 and headers["retry-after"] == "1" and headers["content-type"] == "application/json"
        assert body["error"]["code"] == "too_many_connections" and body["error"]["details"]["limit"] == 3
        reader, writer = await asyncio.open_unix_connection(str(http.daemon.settings.socket))
        refused = orjson.loads(await asyncio.wait_for(reader.readline(), 10))
        assert refused["error"]["code"] == "too_many_connections"
        writer.close()
        idle.close()  # the HTTP one leaves: a Unix client gets in
        while http.daemon.connection_budget.held > 2:
            await asyncio.sleep(0.01)
        async with connected(http.daemon) as late:
            assert (await late.request("system:health"))["status"] == "healthy"
        for client in unix:
            await client.close()
        while http.daemon.connection_budget.held:
            await asyncio.sleep(0.01)
        status, _headers, body = await models_over_http(http.base_url)
        assert status == 200 and body["data"]


async def test_slow_heads_and_idle_connections_are_closed(short_tmp: Path) -> None:
    async with running_http_daemon(short_tmp, http_head_timeout=0.5, http_keepalive_timeout=0.5) as http:
        silent_reader, silent = await http_connection(http.base_url)
        slow_reader, slow = await http_connection(http.base_url)
        slow.write(SLOW_HEAD)
        kept_reader, kept = await http_connection(http.base_url)
        kept.write(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
                   + HTTP_TOKEN.encode() + b"\r\n\r\n")
        # a connection that never sent a byte ends without an answer
        assert await everything_until_closed(silent_reader) == b""
        # a head begun and not finished is told why
        status, _headers, body = parse_response(await everything_until_closed(slow_reader))
        assert status == 408 and body["error"]["code"] == "timeout"
        # a kept-alive connection got its answer, then was closed once idle
        kept_answer = await everything_until_closed(kept_reader)
        assert kept_answer.startswith(b"HTTP/1.1 200") and b'"data"' in kept_answer
        for writer in (silent, slow, kept):
            writer.close()
        while http.daemon.connection_budget.held:
            await asyncio.sleep(0.01)


def test_a_low_descriptor_limit_leaves_room_for_clients() -> None:
    for limit in (256, 512, 1024):
        budget = ConnectionBudget(wanted=1000, listeners=2, limit=limit)
        assert budget.cap >= limit // 2  # the old reserve of 256 descriptors left one connection at 256
        assert budget.cap + 2 * budget.backlog + 64 <= limit
    roomy = ConnectionBudget(wanted=1000, listeners=2, limit=1_048_576)
    assert roomy.cap == 1000


# -- a daemon process at a low descriptor limit -------------------------------------------

DESCRIPTORS = 256


def _low_descriptor_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (DESCRIPTORS, DESCRIPTORS))


@asynccontextmanager
async def daemon_process(root: Path, **env: str) -> AsyncIterator[tuple[Path, str]]:
    """A daemon subprocess limited to DESCRIPTORS open files, serving HTTP on a free port:
    (its socket, its HTTP base URL)."""
    sock = root / "d.sock"
    process = subprocess.Popen(
        [sys.executable, "-m", "ksi_daemon", "--quiet", "--var-dir", str(root / "var"), "--socket", str(sock),
         "--http", "127.0.0.1:0"],
        cwd=root, env={**clean_env(), "KSI_HTTP_TOKEN": HTTP_TOKEN, "KSI_LITELLM_PRELOAD": "false", **env},
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(root / "stderr.log", "wb"),  # noqa: SIM115
        preexec_fn=_low_descriptor_limit,
    )
    try:
        for _ in range(600):
            assert process.poll() is None, (root / "stderr.log").read_text()[-2000:]
            with suppress(OSError, KsiError):
                async with KsiClient(sock) as client:
                    url = (await client.request("system:health"))["http"]
                    break
            await asyncio.sleep(0.05)
        yield sock, url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def a_turn_on_a_new_connection(sock: Path, prompt: str) -> None:
    async with KsiClient(sock) as client:
        assert (await client.request("system:health"))["status"] == "healthy"
        result = await complete(client, prompt=prompt)
        assert result["content"].startswith(f"You said: {prompt}")


async def test_idle_and_slow_http_connections_never_starve_the_daemon(short_tmp: Path) -> None:
    """At 256 descriptors, 300 idle and 100 slow HTTP connections: the old daemon ran out of
    descriptors (its Unix socket then reset every client, and turns failed)."""
    async with daemon_process(short_tmp, KSI_HTTP_HEAD_TIMEOUT="15") as (sock, url):
        await a_turn_on_a_new_connection(sock, "before")  # the first turn loads the tokenizer
        held: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        for n in range(400):
            with suppress(OSError):
                reader, writer = await http_connection(url)
                if n % 4 == 0:
                    writer.write(SLOW_HEAD)
                held.append((reader, writer))
            if n % 100 == 0:
                await a_turn_on_a_new_connection(sock, f"meanwhile {n}")
        await a_turn_on_a_new_connection(sock, "with every connection open")
        # those past the budget were answered at once, in the daemon's shape; the others are
        # closed when their head is late (the slow ones told so)
        endings = await asyncio.gather(*(everything_until_closed(reader) for reader, _writer in held))
        for _reader, writer in held:
            writer.close()
        counted: dict[str, int] = {}
        for ending in endings:
            kind = {b"": "closed", b"<reset>": "reset"}.get(ending) or parse_response(ending)[2]["error"]["code"]
            counted[kind] = counted.get(kind, 0) + 1
        assert counted.get("closed", 0) > 50 and counted.get("timeout", 0) > 20, counted
        assert counted.get("too_many_connections", 0) > 100, counted
        await a_turn_on_a_new_connection(sock, "afterwards")
        status, _headers, body = await models_over_http(url)
        assert status == 200 and body["data"]
        log = (short_tmp / "stderr.log").read_text() + "".join(
            p.read_text() for p in (short_tmp / "var" / "logs" / "daemon").glob("daemon.log*"))
        assert "Too many open files" not in log and "EMFILE" not in log
