"""The token the daemon's HTTP front takes, as the CLI finds it: KSI_HTTP_TOKEN, else the var
dir's token file. When a daemon serves HTTP, the token is tried on it first, so the CLI never
hands out a token the daemon would refuse (a daemon started with another KSI_HTTP_TOKEN, a token
file replaced since)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ksi_common import http_token, oneshot
from ksi_common.errors import ErrorCode, KsiError
from ksi_common.events import SYSTEM_HEALTH
from ksi_common.locate import Location, _dotenv

CHECK_TIMEOUT = 10.0


@dataclass(frozen=True, slots=True)
class FrontAccess:
    token: str
    url: str | None  # the daemon's HTTP address when one serves it


def front_access(location: Location, need_daemon: bool = False) -> FrontAccess:
    """The token to use and, when a daemon serves HTTP, its address (the token checked there);
    with `need_daemon`, a daemon that does not answer is `daemon_unreachable`."""
    # set but empty is refused as the daemon refuses it, not taken for unset
    explicit = os.environ["KSI_HTTP_TOKEN"] if "KSI_HTTP_TOKEN" in os.environ else _dotenv("KSI_HTTP_TOKEN")
    if explicit is not None and (reason := http_token.weakness(explicit)) is not None:
        raise KsiError(ErrorCode.VALIDATION_ERROR, f"invalid settings: KSI_HTTP_TOKEN: {reason}",
                       fields={"KSI_HTTP_TOKEN": reason})
    url = _served_url(location, need_daemon)
    if url is None and need_daemon:  # the daemon serves no HTTP: no token to show, none to write
        return FrontAccess(explicit or "", None)
    if url is None:  # no daemon serves HTTP now: the token its next start will read
        return FrontAccess(explicit or _stored_or_new(location), None)
    try:
        token = explicit or http_token.read(location.layout)
    except http_token.TokenFileError as exc:
        raise KsiError(ErrorCode.STORAGE_ERROR, str(exc)) from None
    if token is None:
        raise KsiError(ErrorCode.UNAUTHORIZED, f"the token file {location.layout.http_token_file} is missing or "
                       "damaged while the daemon serves HTTP: restart the daemon (it writes a new one)")
    if not _accepted(url, token):
        source = "KSI_HTTP_TOKEN" if explicit else str(location.layout.http_token_file)
        raise KsiError(ErrorCode.UNAUTHORIZED, f"the daemon at {url} refuses the token of {source}: it was "
                       "started with another one (KSI_HTTP_TOKEN in its environment?)")
    return FrontAccess(token, url)


def _served_url(location: Location, need_daemon: bool) -> str | None:
    try:
        health = oneshot.request(location.socket, SYSTEM_HEALTH, {}, timeout=CHECK_TIMEOUT)
    except KsiError as error:
        if error.code == ErrorCode.DAEMON_UNREACHABLE and not need_daemon:
            return None
        raise
    url = health.get("http")
    return str(url).rstrip("/") if url else None


def _stored_or_new(location: Location) -> str:
    try:
        return http_token.load_or_create(location.layout)
    except http_token.TokenFileError as exc:
        raise KsiError(ErrorCode.STORAGE_FULL if exc.full else ErrorCode.STORAGE_ERROR, str(exc)) from None


def _accepted(url: str, token: str) -> bool:
    """Whether the daemon takes the token: a cheap authenticated request (the OpenAPI document)."""
    import urllib.error  # only when a daemon serves HTTP: 30 ms of imports otherwise saved
    import urllib.request

    request = urllib.request.Request(f"{url}/openapi.json", headers={"Authorization": f"Bearer {token}"})
    try:
        # no proxy: the daemon is asked directly, whatever HTTP_PROXY says
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(request, timeout=CHECK_TIMEOUT) as response:
            return bool(200 <= response.status < 300)
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            return False
        raise KsiError(ErrorCode.DAEMON_UNREACHABLE, f"the HTTP front at {url} answered {exc.code}") from None
    except OSError as exc:
        raise KsiError(ErrorCode.DAEMON_UNREACHABLE, f"cannot reach the HTTP front at {url}: {exc}") from None
