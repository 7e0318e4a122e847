"""The HTTP front: served on the daemon's loop, token auth on every route, login cookie, lifecycle."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs

from ksi_common.console_login import CODE_LIFETIME, make_code
from ksi_common.errors import ErrorCode
from ksi_daemon.transports.http.binding import HttpBinding, UnsafeHttpBind
from tests.conftest import HTTP_TOKEN, HttpDaemon, make_settings, running_daemon, running_http_daemon


async def test_requests_without_the_token_get_401_in_openai_shape(http_daemon: HttpDaemon) -> None:
    async with httpx.AsyncClient(base_url=http_daemon.base_url) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {HTTP_TOKEN}"}):
            reply = await http.get("/v1/models", headers=headers)
            assert reply.status_code == 401
            assert reply.headers["www-authenticate"].startswith("Bearer")
            assert reply.json()["error"]["code"] == ErrorCode.UNAUTHORIZED
            assert reply.json()["error"]["type"] == "authentication_error"
        # unknown routes are behind the token too: no probing what exists
        assert (await http.get("/nothing-here")).status_code == 401
        ok = await http.get("/v1/models", headers={"Authorization": f"Bearer {HTTP_TOKEN}"})
        assert ok.status_code == 200
        assert ok.json()["object"] == "list"


async def test_a_login_code_opens_a_session_whose_cookie_holds_no_token(http_daemon: HttpDaemon) -> None:
    root = http_daemon.daemon.http.sessions.root
    async with httpx.AsyncClient(base_url=http_daemon.base_url) as http:
        for wrong in ({"token": HTTP_TOKEN}, {"code": "nope"}, {"code": make_code("another-token-0123456789")}):
            refused = await http.get("/login", params=wrong)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == ErrorCode.UNAUTHORIZED
            assert "set-cookie" not in refused.headers
        code = make_code(HTTP_TOKEN)
        login = await http.get("/login", params={"code": code})
        assert login.status_code == 303
        assert login.headers["location"] == f"{root}/"
        cookie = login.headers["set-cookie"]
        assert cookie.startswith("ksi_session=") and HTTP_TOKEN not in cookie
        assert f"Path={root};" in cookie and "HttpOnly" in cookie and "SameSite=Strict" in cookie
        assert (await http.get(f"{root}/v1/models")).status_code == 200  # the client keeps the cookie
        assert (await http.get("/v1/models")).status_code == 401  # only below the cookie's path
        with capture_logs() as logged:
            spent = await http.get("/login", params={"code": code})
        assert spent.status_code == 401  # a code works once
        # someone may have used it first: the log says a spent code came back, and from where
        assert [e["event"] for e in logged if e["log_level"] == "warning"] == ["console_login_refused"]
        assert code not in str(logged)
        session = http.cookies["ksi_session"]
    async with httpx.AsyncClient(base_url=http_daemon.base_url) as other:
        other.cookies.set("ksi_session", session)
        assert (await other.get("/v1/models")).status_code == 401
        other.cookies.set("ksi_session", "made-up")
        assert (await other.get(f"{root}/v1/models")).status_code == 401


async def test_a_login_code_expires_after_a_minute(http_daemon: HttpDaemon) -> None:
    async with httpx.AsyncClient(base_url=http_daemon.base_url) as http:
        old = make_code(HTTP_TOKEN, now=time.time() - CODE_LIFETIME - 1)
        assert (await http.get("/login", params={"code": old})).status_code == 401
        early = make_code(HTTP_TOKEN, now=time.time() + 3600)
        assert (await http.get("/login", params={"code": early})).status_code == 401


async def test_unknown_route_is_404_in_openai_shape(http_daemon: HttpDaemon) -> None:
    async with httpx.AsyncClient(base_url=http_daemon.base_url,
                                 headers={"Authorization": f"Bearer {HTTP_TOKEN}"}) as http:
        reply = await http.get("/v1/nothing")
        assert reply.status_code == 404
        assert reply.json()["error"]["code"] == "not_found"
        assert (await http.delete("/v1/models")).json()["error"]["code"] == "method_not_allowed"


async def test_generated_token_is_owner_only_and_stable_across_restarts(short_tmp: Path) -> None:
    async with running_http_daemon(short_tmp, http_token=None) as first:
        token = first.token
        path = first.daemon.settings.layout.http_token_file
        assert path.read_text().strip() == token and len(token) > 30
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        async with httpx.AsyncClient(base_url=first.base_url) as http:
            assert (await http.get("/v1/models", headers={"Authorization": f"Bearer {token}"})).status_code == 200
    async with running_http_daemon(short_tmp, http_token=None) as second:
        assert second.token == token


def test_non_loopback_bind_needs_an_explicit_token(short_tmp: Path) -> None:
    from ksi_daemon.daemon import Daemon

    with pytest.raises(UnsafeHttpBind, match="explicit token"):
        Daemon(make_settings(short_tmp, http_addr="0.0.0.0:0"))
    Daemon(make_settings(short_tmp, http_addr="0.0.0.0:0", http_token="a-long-explicit-token"))
    assert not (short_tmp / "var").exists() or not any((short_tmp / "var").rglob("http_token"))


@pytest.mark.parametrize(("addr", "host", "port", "loopback"), [
    ("8765", "127.0.0.1", 8765, True),
    ("localhost:1", "localhost", 1, True),
    ("[::1]:80", "::1", 80, True),
    ("10.0.0.1:80", "10.0.0.1", 80, False),
    ("example.org:80", "example.org", 80, False),
])
def test_http_addr_parsing(addr: str, host: str, port: int, loopback: bool) -> None:
    binding = HttpBinding.parse(addr)
    assert (binding.host, binding.port, binding.loopback) == (host, port, loopback)


@pytest.mark.parametrize("addr", ["", "host:", "1:2:x", "70000"])
def test_bad_http_addr_is_refused(addr: str) -> None:
    with pytest.raises(UnsafeHttpBind):
        HttpBinding.parse(addr)


async def test_without_http_addr_nothing_listens(short_tmp: Path) -> None:
    async with running_daemon(short_tmp) as daemon:
        assert daemon.http.url is None
        health: dict[str, Any] = await daemon.router.request("system:health", {}, _root())
        assert health["http"] is None


def _root() -> Any:
    from ksi_daemon.context import EventContext

    return EventContext.root()


async def test_the_listener_sets_nodelay_so_replies_are_not_held_back(http_daemon: HttpDaemon) -> None:
    import socket

    # accepted sockets inherit TCP_NODELAY from the listener (asyncio skips sockets whose proto
    # is 0); without it every keep-alive reply waited ~40 ms for a delayed ACK
    server = http_daemon.daemon.http._server
    assert server is not None
    listener = server.servers[0].sockets[0]
    assert listener.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


async def test_once_the_socket_answers_the_http_front_serves(short_tmp: Path) -> None:
    """A client takes a daemon whose socket answers as started (`ksi daemon start` prints the
    HTTP address from that first health reply): the address must already be served."""
    import asyncio

    from ksi_daemon.daemon import Daemon

    daemon = Daemon(make_settings(short_tmp, http_addr="127.0.0.1:0", http_token=HTTP_TOKEN))
    starting = asyncio.get_running_loop().create_task(daemon.start())
    try:
        while not daemon.settings.socket.exists():  # the first moment a client can connect
            assert not starting.done() or starting.exception() is None
            await asyncio.sleep(0)
        reader, writer = await asyncio.open_unix_connection(str(daemon.settings.socket))
        writer.write(b'{"event": "system:health", "correlation_id": "h"}\n')
        reply = json.loads(await reader.readline())
        writer.close()
        url = reply["data"]["http"]
        assert not url.endswith(":0")
        async with httpx.AsyncClient(base_url=url) as http:
            ok = await http.get("/v1/models", headers={"Authorization": f"Bearer {HTTP_TOKEN}"})
        assert ok.status_code == 200
    finally:
        await starting
        await daemon.shutdown()
