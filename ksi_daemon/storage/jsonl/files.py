"""Durable primitives: append a line (repairing a torn tail), write a new file, replace a file.

None of them follows a symbolic link at the file it writes (O_NOFOLLOW, or an exclusive create,
which never follows one): a link planted in the var dir would have the daemon append to, truncate
or replace whatever it points at. Such a write fails with `storage_symlink`, the target untouched.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import orjson

from ksi_common.errors import ErrorCode, KsiError

_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


def refused_link(path: Path | str) -> KsiError:
    """The error of a write that found a symbolic link where a file of the var dir belongs."""
    return KsiError(ErrorCode.STORAGE_SYMLINK,
                    f"{path} is a symbolic link; the var dir's files are never written through one (remove it)",
                    path=str(path))


class storage_failures:  # noqa: N801 - used as a function: `with storage_failures():`
    """OSErrors of a write as the request's error: storage_full when space or quota ran out,
    storage_error for the rest (EIO, EROFS, ...). A file that exists or is missing is left to
    the caller (exclusive creates and first writes rely on those).

    A class, not a generator: an exchange's writes enter it five times, and a generator-based
    context manager costs five Python calls each time."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 _tb: TracebackType | None) -> None:
        if exc is None or not isinstance(exc, OSError) or isinstance(exc, (FileExistsError, FileNotFoundError)):
            return
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a link
            raise refused_link(exc.filename or "a file") from None
        code = ErrorCode.STORAGE_FULL if exc.errno in _FULL else ErrorCode.STORAGE_ERROR
        raise KsiError(code, f"the var dir could not be written: {exc.strerror or exc}",
                       errno=errno.errorcode.get(exc.errno or 0, str(exc.errno))) from None


def _undo(action: Callable[[], Any]) -> None:
    try:
        action()
    except OSError:
        pass  # the write failed already; its error is the one reported


def _write_all(fd: int, payload: bytes) -> None:
    view = memoryview(payload)
    while view:
        view = view[os.write(fd, view):]


def sync_path(path: Path) -> None:
    """Flush a file, or a directory's entries, to disk."""
    with storage_failures():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def append_lines(path: Path, payload: bytes, fsync: bool) -> None:
    """Append whole lines; a torn last line left by a crash is cut off first.

    One appender per file at a time: a concurrent one could be taken for a torn line.
    """
    created = fsync and not path.exists()  # a new file's directory entry is synced too
    with storage_failures():
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            size = os.lseek(fd, 0, os.SEEK_END)
            if size and os.pread(fd, 1, size - 1) != b"\n":
                _truncate_torn_tail(fd, size)
            start = os.lseek(fd, 0, os.SEEK_END)
            try:
                _write_all(fd, payload)
                if fsync:
                    os.fsync(fd)
            except OSError:
                # no part of lines the caller is told failed may stay (a reader would index them)
                _undo(lambda: os.ftruncate(fd, start))
                raise
        finally:
            os.close(fd)
        if created:
            sync_path(path.parent)


def append_whole(fd: int, payload: bytes) -> None:
    """Append `payload` to the open file `fd` (unsynced); on failure no part of it stays. One
    appender at a time (the caller's lock)."""
    with storage_failures():
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            _write_all(fd, payload)
        except OSError:
            _undo(lambda: os.ftruncate(fd, start))
            raise


def _truncate_torn_tail(fd: int, size: int) -> None:
    position = size
    block = 4096
    while position > 0:
        start = max(0, position - block)
        chunk = os.pread(fd, position - start, start)
        newline = chunk.rfind(b"\n")
        if newline >= 0:
            os.ftruncate(fd, start + newline + 1)
            return
        position = start
    os.ftruncate(fd, 0)


def write_new(path: Path, payload: bytes, fsync: bool) -> None:
    """Write a whole new file; it never overwrites an existing one (nor a link: FileExistsError)."""
    with storage_failures():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            _write_all(fd, payload)
            if fsync:
                os.fsync(fd)
        except OSError:
            os.close(fd)
            _undo(path.unlink)  # a half-written file would read as a torn record
            raise
        os.close(fd)
        if fsync:
            sync_path(path.parent)


def publish_new(path: Path, payload: bytes, fsync: bool) -> None:
    """Write a whole new file that readers see complete or not at all, and only if `path` does
    not exist yet (FileExistsError otherwise): written aside, then hard-linked into place."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{id(payload):x}.new")
    write_new(tmp, payload, fsync)
    try:
        with storage_failures():
            os.link(tmp, path)  # fails when `path` exists: the exclusive part
            if fsync:
                sync_path(path.parent)
    finally:
        _undo(tmp.unlink)


def replace_file(path: Path, payload: bytes, fsync: bool = False) -> None:
    """Replace a file atomically (write aside, then rename); with `fsync`, the new content is on
    disk when this returns."""
    tmp = path.with_name(f".{path.name}.tmp")
    if os.path.islink(path):  # a rename would replace the link, not follow it; still, it is refused
        raise refused_link(path)
    with storage_failures():
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            _write_all(fd, payload)
            if fsync:
                os.fsync(fd)
        except OSError:
            os.close(fd)
            _undo(tmp.unlink)
            raise
        os.close(fd)
        os.replace(tmp, path)
        if fsync:
            sync_path(path.parent)  # the rename itself: without it a crash may bring back the old file


def replace_json(path: Path, value: Any, fsync: bool = False) -> None:
    """Replace a small JSON state file atomically (see replace_file)."""
    replace_file(path, orjson.dumps(value, option=orjson.OPT_INDENT_2, default=str), fsync)


def read_json(path: Path) -> Any:
    try:
        return orjson.loads(path.read_bytes())
    except FileNotFoundError:
        return None


def jsonl(records: list[dict[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(r, default=str, option=orjson.OPT_APPEND_NEWLINE) for r in records)
