"""Who may use the HTTP front: an API client with `Authorization: Bearer <token>`, or a browser
with a session of this daemon.

A browser never holds the token. `ksi console` opens `/login?code=...` with a one-time code signed
by the token (ksi_common.console_login); the daemon spends it and answers with a session cookie:
a random value kept here (hashed) and good only at this daemon until it stops. Browsers send a
cookie to every port of a host, so the cookie's Path is a random prefix of this daemon
(`/s/<random>`), under which every route is served again: a web server on another port of the
same host never learns the prefix, so it never receives the cookie. A request under the prefix
that changes something must come from a page of this daemon (Origin / Sec-Fetch-Site), so a
page elsewhere that learnt the prefix cannot post through the browser's cookie either.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs, urlsplit

import orjson
import structlog
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ksi_common.errors import ErrorCode, KsiError
from ksi_daemon.transports.http.anthropic.errors import error_object
from ksi_daemon.transports.http.errors import error_body, retry_after
from ksi_daemon.transports.http.login_codes import LoginCodes

log = structlog.get_logger("ksi.http")

COOKIE_NAME = "ksi_session"
LOGIN_PATH = "/login"
SESSION_PREFIX = "/s/"
MAX_SESSIONS = 64  # the least recently used session goes first
MAX_SESSION_COOKIES = 4  # session cookies of one request looked at (others may be planted)
SESSION_IDLE = 24 * 3600.0  # seconds a session lasts unused
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})
# clients that meet a 401 look here for an OAuth server: KSI has none, and says so before auth
OAUTH_DISCOVERY = "/.well-known/"
HINT = ("missing or wrong token: send Authorization: Bearer <token> or x-api-key: <token> "
        "(ksi http token prints it); "
        "a browser logs in with ksi console")
LOGIN_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>KSI: log in</title>
<meta name="viewport" content="width=device-width, initial-scale=1"></head>
<body style="font-family: system-ui, sans-serif; max-width: 40em; margin: 3em auto; line-height: 1.5">
<h1>{title}</h1>
<p>On the machine where the daemon runs, run <code>ksi console</code>: it opens the console here,
logged in. <code>ksi console --no-browser</code> prints a login link instead; a link works once,
within a minute.</p>
<p>API clients send <code>Authorization: Bearer &lt;token&gt;</code>; <code>ksi http token</code>
prints the token.</p>
</body></html>
"""


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode()).digest()


class BrowserSessions:
    """The browser sessions of one daemon run, in memory: a restart logs every browser out."""

    def __init__(self, codes: LoginCodes | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.codes = codes or LoginCodes(None)
        self._secret = secrets.token_urlsafe(18)
        self.root = SESSION_PREFIX + self._secret  # the cookie's Path
        self._clock = clock
        self._sessions: OrderedDict[bytes, float] = OrderedDict()  # digest -> last use

    def spend(self, token: str, code: str) -> bool:
        """Take a login code once: signed by the token, within its lifetime, never taken before."""
        return self.codes.spend(token, code)

    def open(self) -> str:
        """A new session; the value goes into the cookie, only its digest stays here."""
        value = secrets.token_urlsafe(32)
        self._sessions[_digest(value)] = self._clock()
        while len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)
        return value

    def valid(self, value: str | None) -> bool:
        if not value:
            return False
        key = _digest(value)
        used = self._sessions.get(key)
        now = self._clock()
        if used is None:
            return False
        if now - used > SESSION_IDLE:
            del self._sessions[key]
            return False
        self._sessions[key] = now
        self._sessions.move_to_end(key)
        return True

    def under_root(self, path: str) -> bool:
        if not path.startswith(SESSION_PREFIX):
            return False
        segment = path[len(SESSION_PREFIX):].partition("/")[0]
        # compared in constant time: the prefix is what keeps the cookie from other servers
        return hmac.compare_digest(segment.encode(), self._secret.encode())


class TokenAuth:
    """ASGI middleware in front of every route (a plain ASGI one, so streams pass untouched)."""

    def __init__(self, app: ASGIApp, token: str, sessions: BrowserSessions, port: int, loopback: bool) -> None:
        self.app = app
        self._token = token
        self._token_bytes = token.encode()
        self.sessions = sessions
        self.port = port
        self.loopback = loopback

    def accepts(self, presented: str | None) -> bool:
        return presented is not None and hmac.compare_digest(presented.encode(), self._token_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if scope["type"] == "http" and path.startswith(OAUTH_DISCOVERY):
            await _reply(send, 404, error_body(KsiError(ErrorCode.NOT_FOUND, "KSI has no OAuth: send the bearer "
                                                                              "token (ksi http token prints it)")))
            return
        if scope["type"] == "http" and path == LOGIN_PATH:
            await self._login(scope, send)
            return
        under_root = self.sessions.under_root(path)
        if under_root:
            # every route again under the session's prefix: the routers match below root_path
            scope = {**scope, "root_path": self.sessions.root}
            send = _with_referrer_policy(send)
        if self.accepts(_bearer(scope)):
            await self.app({**scope, "ksi.auth": "bearer"}, receive, send)
            return
        if under_root and any(self.sessions.valid(value) for value in _session_cookies(scope)):
            # a WebSocket handshake is a GET that changes things: it must come from this daemon's pages too
            changes = scope["type"] == "websocket" or scope.get("method", "GET") not in SAFE_METHODS
            if changes and not self._same_origin(scope):
                await _reply(_answering(scope, send), 403, error_body(KsiError(
                    ErrorCode.CROSS_SITE_REQUEST, "refused: a browser session changes things only from this "
                                                  "daemon's own pages")))
                return
            await self.app({**scope, "ksi.auth": "session"}, receive, send)
            return
        await self._unauthorized(scope, _answering(scope, send), "This KSI daemon needs a login")

    def _same_origin(self, scope: Scope) -> bool:
        """The request comes from a page of this daemon: its Origin is this host and port, and the
        browser does not call it cross-origin. A browser sends at least one of the two."""
        host = _header(scope, b"host")
        origin = _header(scope, b"origin")
        fetch_site = _header(scope, b"sec-fetch-site")
        if host is None or not self._own_host(host) or (origin is None and fetch_site is None):
            return False
        if fetch_site is not None and fetch_site != "same-origin":
            return False
        return origin is None or origin == f"http://{host}"

    def _own_host(self, host: str) -> bool:
        parts = urlsplit(f"http://{host}")
        try:
            port = parts.port
        except ValueError:
            return False
        if port != self.port:
            return False
        return not self.loopback or (parts.hostname or "") in LOOPBACK_NAMES

    async def _login(self, scope: Scope, send: Send) -> None:
        """A one-time code for a session cookie, then on to the console (the URL with the code
        is left behind; the code is spent)."""
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        code = (query.get("code") or [""])[0]
        client = "{}:{}".format(*scope["client"]) if scope.get("client") else None
        wait = self.sessions.codes.retry_after()
        if wait is not None:  # too many wrong codes lately: not even checked, nor logged one by one
            error = KsiError(ErrorCode.TOO_MANY_LOGIN_ATTEMPTS, "too many wrong login codes: retry later "
                             "with a fresh one from ksi console", retry_after=round(wait + 0.5))
            await _reply(send, 429, error_body(error), [(b"retry-after", str(retry_after(error)).encode())])
            return
        if not self.sessions.spend(self._token, code):
            # a spent code used again may mean someone else used it first: worth a line in the log
            log.warning("console_login_refused", client=client)
            await self._unauthorized(scope, send, "This login link is spent, expired or wrong",
                                     "the login code is spent, expired or wrong: run ksi console again")
            return
        log.info("console_login", client=client)
        root = self.sessions.root
        cookie = f"{COOKIE_NAME}={self.sessions.open()}; Path={root}; HttpOnly; SameSite=Strict"
        await send({"type": "http.response.start", "status": 303,
                    "headers": [(b"location", f"{root}/".encode()), (b"set-cookie", cookie.encode()),
                                (b"content-length", b"0"), (b"cache-control", b"no-store"),
                                (b"referrer-policy", b"no-referrer")]})
        await send({"type": "http.response.body", "body": b""})

    async def _unauthorized(self, scope: Scope, send: Send, title: str, message: str = HINT) -> None:
        challenge = f'Bearer realm="ksi", error="invalid_token", error_description="{message}"'.encode()
        headers = [(b"www-authenticate", challenge), (b"cache-control", b"no-store")]
        if "text/html" in (_header(scope, b"accept") or ""):
            page = LOGIN_PAGE.format(title=title).encode()
            await send({"type": "http.response.start", "status": 401, "headers": [
                (b"content-type", b"text/html; charset=utf-8"), (b"content-length", str(len(page)).encode()),
                *headers]})
            await send({"type": "http.response.body", "body": page})
            return
        refused = KsiError(ErrorCode.UNAUTHORIZED, message)
        if _header(scope, b"anthropic-version") is not None:  # an Anthropic client reads its own shape
            await _reply(send, 401, error_object(refused), [*headers, (b"x-should-retry", b"false")])
            return
        await _reply(send, 401, error_body(refused), headers)


def _answering(scope: Scope, send: Send) -> Send:
    """`send` for an HTTP answer: a WebSocket handshake is refused with one (ASGI's
    websocket.http.response extension), so its client reads the same error as an HTTP one."""
    if scope["type"] != "websocket":
        return send

    async def refuse_handshake(message: Message) -> None:
        await send({**message, "type": "websocket." + message["type"]})

    return refuse_handshake


async def _reply(send: Send, status: int, body: dict[str, Any],
                 headers: list[tuple[bytes, bytes]] | None = None) -> None:
    payload = orjson.dumps(body)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": payload})


def _with_referrer_policy(send: Send) -> Callable[[Message], Awaitable[None]]:
    """Pages under the session prefix never name it to another site in a Referer header."""
    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), (b"referrer-policy", b"same-origin")]}
        await send(message)

    return sending


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


def _bearer(scope: Scope) -> str | None:
    """The token of `Authorization: Bearer`, or of `x-api-key` (how Anthropic's clients send it)."""
    value = _header(scope, b"authorization")
    if value is None:
        return _header(scope, b"x-api-key")
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def _session_cookies(scope: Scope) -> list[str]:
    """Every session cookie the request carries, at most a few. Cookies are shared by the ports of
    a host, so a page of another local server can plant one with our name: it must not hide ours
    (a parser that keeps one value per name would keep the last)."""
    header = _header(scope, b"cookie") or ""
    values = []
    for pair in header.split(";"):
        name, sep, value = pair.partition("=")
        if sep and name.strip() == COOKIE_NAME:
            values.append(value.strip().strip('"'))
            if len(values) == MAX_SESSION_COOKIES:
                break
    return values
