"""A browser session of the HTTP front over plain HTTP: what it may change and from where, the
body types and sizes it is read in, and what a client without credentials is told."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from ksi_common.console_login import make_code
from ksi_daemon.transports.http.auth import MAX_SESSIONS, SESSION_IDLE, BrowserSessions
from tests.conftest import HTTP_TOKEN, HttpDaemon, complete, connected, running_http_daemon

ITEMS = {"items": [{"type": "message", "role": "user", "content": "planted question"},
                   {"type": "message", "role": "assistant", "content": "planted answer"}]}


def on_disk(served: HttpDaemon) -> dict[str, bytes]:
    """Every stored file of the var dir (the daemon's own log, run files and exchange journal aside:
    the journal empties itself once an exchange's files are written; and the login codes spent)."""
    root = served.daemon.settings.var_dir
    return {str(path.relative_to(root)): path.read_bytes() for path in sorted(root.rglob("*"))
            if path.is_file() and path.relative_to(root).parts[:2] != ("logs", "daemon")
            and path.relative_to(root).parts[0] != "run"
            and path.relative_to(root).parts[:2] != ("state", "exchange-log")
            and path.relative_to(root).parts != ("state", "console_codes.json")}


@pytest_asyncio.fixture
async def served(short_tmp: Path) -> AsyncIterator[HttpDaemon]:
    async with running_http_daemon(short_tmp, line_limit=64 * 1024) as running, connected(running.daemon) as client:
        await complete(client, prompt="the original turn", model="echo/x", conversation_id="target", create=True)
        yield running


@asynccontextmanager
async def logged_in(served: HttpDaemon) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=served.base_url, timeout=30.0) as http:
        assert (await http.get("/login", params={"code": make_code(HTTP_TOKEN)})).status_code == 303
        yield http


def own_origin(served: HttpDaemon) -> dict[str, str]:
    return {"Origin": served.base_url, "Sec-Fetch-Site": "same-origin"}


async def test_a_session_changes_nothing_from_another_origin_on_any_route(served: HttpDaemon) -> None:
    root = served.daemon.http.sessions.root
    port = served.base_url.rsplit(":", 1)[1]
    before = on_disk(served)
    foreign = [
        {},  # no Origin, no Sec-Fetch-Site: not a page of this daemon
        {"Origin": "http://127.0.0.1:1"},  # another port of the same host: the same site, another origin
        {"Sec-Fetch-Site": "same-site"},
        {"Sec-Fetch-Site": "cross-site"},
        {"Origin": "null"},
        {"Origin": f"http://evil.example:{port}", "Host": f"evil.example:{port}"},  # a rebound name
        {"Origin": served.base_url, "Sec-Fetch-Site": "same-site"},
    ]
    routes: list[tuple[str, str, Any]] = [
        ("POST", "/v1/responses", {"model": "echo/x", "input": "planted", "conversation": "target"}),
        ("POST", "/v1/conversations/target/items", ITEMS),
        ("POST", "/v1/conversations/target", {"metadata": {"planted": "yes"}}),
        ("POST", "/v1/conversations", ITEMS),
        ("POST", "/v1/chat/completions", {"model": "echo/x", "messages": [{"role": "user", "content": "planted"}]}),
        ("DELETE", "/v1/conversations/target", None),
        ("POST", "/conversations/target/archive", None),
    ]
    async with logged_in(served) as http:
        for headers in foreign:
            for method, path, body in routes:
                reply = await http.request(method, root + path, json=body, headers=headers)
                assert reply.status_code == 403, (method, path, headers, reply.text)
                assert reply.json()["error"]["code"] == "cross_site_request"
            for path in ("/conversations/target/send", "/conversations/target/fork"):
                reply = await http.post(root + path, data={"prompt": "planted", "at": "1"}, headers=headers)
                assert reply.status_code == 403, (path, headers)
        assert on_disk(served) == before
        # from its own pages the same session does change things
        updated = await http.post(root + "/v1/conversations/target", json={"metadata": {"kept": "yes"}},
                                  headers=own_origin(served))
        assert updated.status_code == 200, updated.text
        assert updated.json()["metadata"]["kept"] == "yes"


async def test_a_session_posts_json_only_as_application_json(served: HttpDaemon) -> None:
    root = served.daemon.http.sessions.root
    before = on_disk(served)
    body = b'{"model": "echo/x", "input": "planted", "conversation": "target"}'
    async with logged_in(served) as http:
        for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
            headers = {**own_origin(served), **({"Content-Type": kind} if kind else {})}
            for path in ("/v1/responses", "/v1/conversations/target/items", "/v1/conversations/target"):
                reply = await http.post(root + path, content=body, headers=headers)
                assert reply.status_code == 415, (path, kind, reply.text)
                assert reply.json()["error"]["code"] == "unsupported_media_type"
    assert on_disk(served) == before
    # a bearer client is not a browser: its body is read whatever it says it is
    async with httpx.AsyncClient(base_url=served.base_url, timeout=30.0,
                                 headers={"Authorization": f"Bearer {HTTP_TOKEN}"}) as api:
        reply = await api.post("/v1/conversations/target", content=b'{"metadata": {"from": "api"}}',
                               headers={"Content-Type": "text/plain"})
        assert reply.status_code == 200 and reply.json()["metadata"]["from"] == "api"


async def exchange(served: HttpDaemon, head: bytes, body: bytes) -> bytes:
    """Send a request by hand (a head, then as much body as the daemon reads) and return its answer."""
    host, port = served.base_url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(head)
        await writer.drain()
        if body:
            writer.write(body)
            await writer.drain()
        return await asyncio.wait_for(reader.read(65536), 30)
    finally:
        writer.close()


async def test_a_console_form_past_the_limit_is_refused_before_it_is_read(served: HttpDaemon,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    spool = Path(tempfile.mkdtemp(prefix="ksi-spool-", dir="/tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(spool))  # where a parser would spool uploads
    root = served.daemon.http.sessions.root
    before = on_disk(served)
    async with logged_in(served) as http:
        cookie = f"ksi_session={http.cookies['ksi_session']}"
        origin = f"Origin: {served.base_url}\r\nHost: {served.base_url.removeprefix('http://')}\r\nCookie: {cookie}\r\n"
        # a declared length past the limit: answered at once, not one byte of the body sent
        head = (f"POST {root}/conversations/target/send HTTP/1.1\r\n{origin}"
                "Content-Type: application/x-www-form-urlencoded\r\nContent-Length: 1073741824\r\n\r\n").encode()
        answer = await exchange(served, head, b"")
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert b'"payload_too_large"' in answer
        # no length: chunks are read until the limit, then refused
        head = (f"POST {root}/conversations/target/fork HTTP/1.1\r\n{origin}"
                "Content-Type: application/x-www-form-urlencoded\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
        chunk = b"x" * 65536
        body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(3))
        answer = await exchange(served, head, b"8\r\nprompt=a\r\n" + body)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        # a multipart upload is not read at all: the console's forms take no files
        upload = await http.post(root + "/conversations/target/send", headers=own_origin(served),
                                 data={"prompt": "planted"}, files={"file": ("big.bin", b"\0" * 200_000)})
        assert upload.status_code in (413, 415), upload.text
        small = await http.post(root + "/conversations/target/send", headers=own_origin(served),
                                data={"prompt": "planted"}, files={"file": ("small.bin", b"\0" * 10)})
        assert small.status_code == 415 and small.json()["error"]["code"] == "unsupported_media_type"
        health = await http.get(root + "/v1/models")
        assert health.status_code == 200
    assert on_disk(served) == before
    assert list(spool.iterdir()) == []
    spool.rmdir()


@pytest.mark.parametrize("path", ["/.well-known/oauth-protected-resource", "/.well-known/oauth-authorization-server",
                                  "/.well-known/oauth-protected-resource/mcp", "/.well-known/openid-configuration"])
async def test_oauth_discovery_is_404_before_auth(served: HttpDaemon, path: str) -> None:
    async with httpx.AsyncClient(base_url=served.base_url) as http:
        reply = await http.get(path)
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "not_found"
    assert "www-authenticate" not in reply.headers


async def test_a_401_says_how_to_log_in(served: HttpDaemon) -> None:
    async with httpx.AsyncClient(base_url=served.base_url) as http:
        api = await http.get("/v1/models")
        assert api.status_code == 401 and api.json()["error"]["code"] == "unauthorized"
        challenge = api.headers["www-authenticate"]
        assert challenge.startswith("Bearer ") and 'error="invalid_token"' in challenge
        assert "error_description=" in challenge and "ksi http token" in challenge
        page = await http.get("/", headers={"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"})
        assert page.status_code == 401 and page.headers["content-type"].startswith("text/html")
        assert "ksi console" in page.text and page.headers["www-authenticate"] == challenge
        mcp = await http.post("/mcp", json={}, headers={"Accept": "application/json, text/event-stream"})
        assert mcp.status_code == 401 and mcp.json()["error"]["code"] == "unauthorized"


def test_sessions_end_unused_and_the_oldest_goes_past_the_cap() -> None:
    now = [1000.0]
    sessions = BrowserSessions(clock=lambda: now[0])
    first = sessions.open()
    assert sessions.valid(first) and not sessions.valid("made-up") and not sessions.valid(None)
    now[0] += SESSION_IDLE - 1
    assert sessions.valid(first)  # a use keeps it open
    now[0] += SESSION_IDLE + 1
    assert not sessions.valid(first)
    root = sessions.root
    assert sessions.under_root(root) and sessions.under_root(root + "/conversations")
    assert not any(sessions.under_root(path) for path in ("/s/", root + "x/", root[:-1] + "/", "/", "/v1/models"))
    kept = [sessions.open() for _ in range(MAX_SESSIONS + 1)]
    assert not sessions.valid(kept[0]) and all(sessions.valid(value) for value in kept[1:])


def test_a_login_code_is_taken_once_and_only_as_signed() -> None:
    sessions = BrowserSessions()
    code = make_code(HTTP_TOKEN)
    issued, nonce, signature = code.split(".")
    forged = [f"{int(issued) + 1}.{nonce}.{signature}", f"{issued}.other.{signature}", f"{issued}.{nonce}.{'0' * 64}",
              "", "...", f"{issued}.{nonce}", "x" * 200,
              f"{issued[:-1]}\u00b2.{nonce}.{signature}",  # a digit to str.isdigit, not to int()
              f"{issued}.{nonce}.{signature[:-1]}\u00e9"]  # a signature that is not ASCII
    assert not any(sessions.spend(HTTP_TOKEN, wrong) for wrong in forged)
    assert not sessions.spend("another-token-0123456789", code)
    assert sessions.spend(HTTP_TOKEN, code)
    assert not sessions.spend(HTTP_TOKEN, code)


async def test_a_cookie_planted_by_another_local_server_does_not_hide_the_session(served: HttpDaemon) -> None:
    """Cookies are shared by every port of a host: a page elsewhere can set one named like ours."""
    root = served.daemon.http.sessions.root
    async with logged_in(served) as http:
        real = http.cookies.get("ksi_session")
        assert real
        for planted in (f"ksi_session=planted; ksi_session={real}", f"ksi_session={real}; ksi_session=planted"):
            reply = await http.get(root + "/conversations", headers={"Cookie": planted})
            assert reply.status_code == 200, planted
        only_planted = await http.get(root + "/conversations", headers={"Cookie": "ksi_session=planted"})
        assert only_planted.status_code == 401
