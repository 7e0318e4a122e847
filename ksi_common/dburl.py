"""Database URLs as they may be shown: the password (in the user part or a `password=` query
parameter) replaced by `***`, in a URL alone or anywhere inside a text."""

from __future__ import annotations

import re
from urllib.parse import unquote

MASK = "***"
_IN_TEXT = re.compile(r"(postgres(?:ql)?://[^\s:/@]*:)[^\s@]*@")
_QUERY_PASSWORD = re.compile(r"([?&]password=)[^&#\s]*", re.IGNORECASE)


def mask_url(url: str) -> str:
    """`url` with its password masked; a URL without one is returned unchanged."""
    scheme, sep, rest = url.partition("://")
    if sep:
        userinfo, at, hosts = rest.rpartition("@")
        if at and ":" in userinfo:
            user = userinfo.split(":", 1)[0]
            url = f"{scheme}://{user}:{MASK}@{hosts}"
    return _QUERY_PASSWORD.sub(rf"\g<1>{MASK}", url)


def mask_urls_in(text: str) -> str:
    """Every database URL inside `text` with its password masked."""
    return _QUERY_PASSWORD.sub(rf"\g<1>{MASK}", _IN_TEXT.sub(rf"\g<1>{MASK}@", text))


def url_password(url: str) -> str | None:
    """The password a URL carries (so a redactor can hide it wherever else it appears)."""
    _scheme, sep, rest = url.partition("://")
    userinfo, at, _hosts = rest.rpartition("@")
    if sep and at and ":" in userinfo:
        return unquote(userinfo.split(":", 1)[1]) or None
    found = re.search(r"[?&]password=([^&#\s]*)", url, re.IGNORECASE)
    return unquote(found.group(1)) if found else None
