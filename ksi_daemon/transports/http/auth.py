"""Every HTTP request must carry the token: `Authorization: Bearer ...` or the `ksi_token` cookie
that `GET /login?token=...` sets for a browser. Tokens are compared in constant time."""

from __future__ import annotations

import hmac
from typing import Any
from urllib.parse import parse_qs

import orjson
from starlette.requests import cookie_parser
from starlette.types import ASGIApp, Receive, Scope, Send

from ksi_common.errors import ErrorCode, KsiError
from ksi_daemon.transports.http.errors import error_body

COOKIE_NAME = "ksi_token"
LOGIN_PATH = "/login"


def _json_reply(status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]]) -> tuple[dict[str, Any], dict[str, Any]]:
    payload = orjson.dumps(body)
    start = {"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(payload)).encode()), *headers]}
    return start, {"type": "http.response.body", "body": payload}


class TokenAuth:
    """ASGI middleware in front of every route (a plain ASGI one, so streams pass untouched)."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self._token = token.encode()

    def accepts(self, presented: str | None) -> bool:
        return presented is not None and hmac.compare_digest(presented.encode(), self._token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "http" and scope["path"] == LOGIN_PATH:
            await self._login(scope, send)
            return
        if self.accepts(_bearer(scope)) or self.accepts(_cookie(scope)):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        error = KsiError(ErrorCode.UNAUTHORIZED, "missing or wrong token: send `Authorization: Bearer <token>` "
                         "(the token is printed by `ksi http token`)")
        for message in _json_reply(401, error_body(error), [(b"www-authenticate", b'Bearer realm="ksi"')]):
            await send(message)

    async def _login(self, scope: Scope, send: Send) -> None:
        """A browser logs in once by URL; the cookie then carries the token (never readable by scripts)."""
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        token = (query.get("token") or [None])[0]
        if not self.accepts(token):
            error = KsiError(ErrorCode.UNAUTHORIZED, "wrong or missing `token` query parameter")
            for message in _json_reply(401, error_body(error), []):
                await send(message)
            return
        cookie = f"{COOKIE_NAME}={token}; Path=/; HttpOnly; SameSite=Strict".encode()
        await send({"type": "http.response.start", "status": 303,
                    "headers": [(b"location", b"/"), (b"set-cookie", cookie), (b"content-length", b"0"),
                                (b"cache-control", b"no-store")]})
        await send({"type": "http.response.body", "body": b""})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


def _bearer(scope: Scope) -> str | None:
    value = _header(scope, b"authorization")
    if value is None:
        return None
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def _cookie(scope: Scope) -> str | None:
    value = _header(scope, b"cookie")
    return cookie_parser(value).get(COOKIE_NAME) if value else None
