"""The HTTP front's bearer token: the explicit setting, else one generated once into the var dir.

A token is at least MIN_LENGTH visible ASCII characters (it travels in a header) and not one
character repeated; anything else is refused where it is set (KSI_HTTP_TOKEN) and replaced where
it is stored (an empty or cut token file left by a full disk).
"""

from __future__ import annotations

import errno
import os
import secrets

from ksi_common.layout import VarLayout

MIN_LENGTH = 16
MAX_LENGTH = 4096


class TokenFileError(RuntimeError):
    """The token file cannot be written (a full disk, a read-only var dir): no token is made up."""

    def __init__(self, message: str, full: bool) -> None:
        super().__init__(message)
        self.full = full


def weakness(token: str) -> str | None:
    """Why `token` is refused as a bearer token, or None when it is fit."""
    if len(token) < MIN_LENGTH:
        return f"a token needs at least {MIN_LENGTH} characters"
    if len(token) > MAX_LENGTH:
        return f"a token has at most {MAX_LENGTH} characters"
    if any(not "!" <= char <= "~" for char in token):
        return "a token is visible ASCII characters only (no spaces)"
    if len(set(token)) == 1:
        return "a token is not one character repeated"
    return None


def read(layout: VarLayout) -> str | None:
    """The token stored in the var dir, or None when there is none or it is empty or damaged."""
    try:
        text = layout.http_token_file.read_text(encoding="ascii", errors="replace").strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:  # unreadable, or a directory in its place: say so, not a traceback
        raise TokenFileError(f"cannot read the HTTP token file {layout.http_token_file}: {exc.strerror or exc}",
                             False) from None
    return text if weakness(text) is None else None


def load_or_create(layout: VarLayout) -> str:
    """The stored token; when there is none (or it is damaged) a new one, written before it is returned."""
    return read(layout) or _create(layout)


def _create(layout: VarLayout) -> str:
    path = layout.http_token_file
    token = f"ksi-{secrets.token_urlsafe(32)}"
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(6)}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w", encoding="ascii") as handle:
                handle.write(token + "\n")
                handle.flush()
                os.fsync(handle.fileno())
            if path.exists():
                os.replace(temporary, path)  # an empty or damaged file: replaced whole
            else:
                try:
                    # never over a file another process has just written: then its token is the one
                    os.link(temporary, path)
                except FileExistsError:
                    winner = read(layout)
                    if winner:
                        return winner
                    os.replace(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)
    except OSError as exc:
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        raise TokenFileError(f"cannot write the HTTP token file {path}: {exc.strerror or exc}", full) from None
    return token
