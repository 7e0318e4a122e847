"""One-time login codes for the web console: `ksi console` makes one from the HTTP token, the
daemon checks it, lets it in once and only within CODE_LIFETIME seconds. The token itself never
goes into a URL, so never into a browser's command line or history; a code seen there is spent
or expired."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time

CODE_LIFETIME = 60  # seconds: time for a browser to start, not for a code to be kept
CLOCK_SKEW = 5  # a code issued this far in the daemon's future is still taken


def _signature(token: str, issued: int, nonce: str) -> str:
    key = hmac.new(token.encode(), b"ksi console login", hashlib.sha256).digest()
    return hmac.new(key, f"{issued}.{nonce}".encode(), hashlib.sha256).hexdigest()


def make_code(token: str, now: float | None = None) -> str:
    """A fresh code: when it was issued, a random nonce, and a signature by the token."""
    issued = int(time.time() if now is None else now)
    nonce = secrets.token_urlsafe(18)
    return f"{issued}.{nonce}.{_signature(token, issued, nonce)}"


def code_nonce(token: str, code: str, now: float) -> tuple[str, float] | None:
    """The nonce of a code signed by `token` and still in its lifetime, with when it expires;
    None for any other code. Whether the nonce was already spent is the caller's to remember."""
    issued_text, _, rest = code.partition(".")
    nonce, _, signature = rest.partition(".")
    if not (issued_text.isascii() and issued_text.isdigit()) or not nonce or len(issued_text) > 12:
        return None
    issued = int(issued_text)
    if not issued - CLOCK_SKEW <= now <= issued + CODE_LIFETIME:
        return None
    if not hmac.compare_digest(signature.encode(), _signature(token, issued, nonce).encode()):
        return None
    return nonce, issued + CODE_LIFETIME
