"""Database URLs as they may be shown: the password (in the user part, a `password=` query
parameter, or the `password=` pair of a key/value DSN such as `host=db password='x y'`) replaced
by `***`, in a URL alone or anywhere inside a text."""

from __future__ import annotations

import re
from urllib.parse import unquote

MASK = "***"
_IN_TEXT = re.compile(r"(postgres(?:ql)?://[^\s:/@]*:)[^\s@]*@")
_QUERY_PASSWORD = re.compile(r"([?&]password=)[^&#\s]*", re.IGNORECASE)
# libpq's key/value form: spaces may surround `=`, a value in single quotes may hold spaces and
# backslash escapes (\' and \\); a word of its own, never a URL's query parameter
_PAIR_PASSWORD = re.compile(r"((?<![\w?&%.-])password\s*=\s*)('(?:[^'\\]|\\.)*'?|[^\s']\S*)", re.IGNORECASE)
# inside a text, a DSN may be quoted: a `"` closing it is not part of the password
_PAIR_PASSWORD_IN_TEXT = re.compile(r"((?<![\w?&%.-])password\s*=\s*)('(?:[^'\\]|\\.)*'?|[^\s']\S*?(?=\"?(?:\s|$)))",
                                    re.IGNORECASE)


def mask_url(url: str) -> str:
    """`url` with its password masked; a URL without one is returned unchanged."""
    scheme, sep, rest = url.partition("://")
    if sep:
        userinfo, at, hosts = rest.rpartition("@")
        if at and ":" in userinfo:
            user = userinfo.split(":", 1)[0]
            url = f"{scheme}://{user}:{MASK}@{hosts}"
        return _QUERY_PASSWORD.sub(rf"\g<1>{MASK}", url)
    return _PAIR_PASSWORD.sub(rf"\g<1>{MASK}", url)


def mask_urls_in(text: str) -> str:
    """Every database URL and key/value DSN inside `text` with its password masked."""
    masked = _QUERY_PASSWORD.sub(rf"\g<1>{MASK}", _IN_TEXT.sub(rf"\g<1>{MASK}@", text))
    return _PAIR_PASSWORD_IN_TEXT.sub(rf"\g<1>{MASK}", masked)


def url_password(url: str) -> str | None:
    """The password a URL carries (so a redactor can hide it wherever else it appears)."""
    _scheme, sep, rest = url.partition("://")
    userinfo, at, _hosts = rest.rpartition("@")
    if sep and at and ":" in userinfo:
        return unquote(userinfo.split(":", 1)[1]) or None
    if sep:
        found = re.search(r"[?&]password=([^&#\s]*)", url, re.IGNORECASE)
        return unquote(found.group(1)) if found else None
    pair = _PAIR_PASSWORD.search(url)
    if pair is None:
        return None
    value = pair.group(2)
    if value.startswith("'"):
        value = re.sub(r"\\(.)", r"\1", value[1:-1] if value.endswith("'") and len(value) > 1 else value[1:])
    return value or None
