"""The exchange log `state/exchange-log/N.jsonl`: how an exchange is made durable with one fsync.

With fsync on, an exchange touches up to three files (its response record, its index line and,
for a conversation made for it, the metadata), and syncing each file and its directory costs six
fsyncs for a new conversation, three for a continued one. Instead the exchange is first appended
here as one line and synced; the files are then written without syncing, and every few seconds a
checkpoint syncs the whole file system once (syncfs) and drops the log. After a crash of the
machine, the daemon replays what the log holds before it serves anything
(`JsonlConversations.replay_log`): each record writes only what is missing, so a record applied
twice changes nothing.

Only the append itself is serialised: the fsyncs of concurrent exchanges run at once, and one
covers every record appended before it. When an exchange's files cannot be written after its
record was synced, a revoking line follows it, so an exchange reported failed is not written
again at replay. A checkpoint waits for exchanges still writing their files before it syncs.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import structlog

from ksi_common.errors import KsiError
from ksi_common.exchange_log import generations, logged_exchanges
from ksi_daemon.storage.jsonl.files import append_whole, storage_failures, sync_path

log = structlog.get_logger("ksi.storage.exchange_log")


def _file_system_sync() -> Callable[[int], None]:
    """syncfs(2) on Linux: one call makes every file written on that file system durable; else
    sync(2), which does the same for every file system."""
    if sys.platform.startswith("linux"):
        import ctypes  # here, not at import: only a checkpoint needs it, never the daemon's start

        libc = ctypes.CDLL(None, use_errno=True)

        def syncfs(fd: int) -> None:
            if libc.syncfs(fd) != 0:
                code = ctypes.get_errno()
                raise OSError(code, os.strerror(code))

        return syncfs
    return lambda _fd: os.sync()


@dataclass(eq=False)
class _Generation:
    path: Path
    fd: int
    writing: int = 0  # exchanges whose record is appended and whose files are not written yet


class ExchangeLog:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock = threading.Condition()
        self._checkpointing = threading.Lock()
        self._current: _Generation | None = None  # opened by the first record after a checkpoint
        self._sealed: list[_Generation] = []  # closed for appends, dropped by the next checkpoint
        self._next = 0
        self._syncfs: Callable[[int], None] | None = None  # found at the first checkpoint

    @property
    def pending(self) -> bool:
        """Whether records wait for a checkpoint."""
        return self._current is not None or bool(self._sealed)

    def generations(self) -> list[Path]:
        """The log's files, oldest first."""
        return generations(self.directory)

    def records(self) -> list[dict[str, Any]]:
        """Every record not revoked, oldest first (see ksi_common.exchange_log)."""
        return logged_exchanges(self.directory)

    @contextmanager
    def committing(self, record_id: str, record: dict[str, Any]) -> Iterator[None]:
        """Append `record` under `record_id` and sync it, then run the body (which writes the
        exchange's files); when the body fails, the record is revoked before the error goes on."""
        payload = orjson.dumps({"id": record_id, **record}, option=orjson.OPT_APPEND_NEWLINE, default=str)
        with self._lock:
            generation = self._open()
            append_whole(generation.fd, payload)
            generation.writing += 1
        try:
            try:
                with storage_failures():
                    os.fsync(generation.fd)
                yield
            except BaseException:
                self._revoke(generation, record_id)
                raise
        finally:
            with self._lock:
                generation.writing -= 1
                self._lock.notify_all()

    def _revoke(self, generation: _Generation, record_id: str) -> None:
        try:
            with self._lock:
                append_whole(generation.fd, orjson.dumps({"revoke": record_id}, option=orjson.OPT_APPEND_NEWLINE))
            with storage_failures():
                os.fsync(generation.fd)
        except KsiError as error:
            # not replayed either way unless the machine goes down before the next checkpoint
            log.warning("exchange_log_revoke_failed", code=error.code, record=record_id)

    def _open(self) -> _Generation:
        if self._current is None:
            self._next = max(self._next, *(int(p.stem) + 1 for p in self.generations()), 0)
            path = self.directory / f"{self._next}.jsonl"
            with storage_failures():
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                sync_path(self.directory)  # found again after a crash
            except KsiError:
                os.close(fd)  # left empty: nothing to replay from it
                raise
            self._current = _Generation(path, fd)
            self._next += 1
        return self._current

    def checkpoint(self) -> None:
        """Make every file written so far durable, then drop the records that covered them
        (blocking). Records appended meanwhile go to a new generation and wait for the next.

        One checkpoint at a time: two would both close the same generations' descriptors, and
        the second close could hit a descriptor number already given to another file."""
        with self._checkpointing:
            with self._lock:
                if self._current is not None:
                    self._sealed.append(self._current)
                    self._current = None
                sealed = list(self._sealed)
                while any(generation.writing for generation in sealed):  # their files are being written
                    self._lock.wait()
            if not sealed:
                return
            self.sync_all()  # on failure the sealed generations stay for the next checkpoint
            with self._lock:
                for generation in sealed:
                    os.close(generation.fd)
                    generation.path.unlink(missing_ok=True)
                    self._sealed.remove(generation)

    def sync_all(self, directory: Path | None = None) -> None:
        """Every file written on the var dir's file system (the one `directory` is on, by
        default the log's), durable (blocking)."""
        with storage_failures():
            fd = os.open(directory or self.directory, os.O_RDONLY)
            try:
                if self._syncfs is None:
                    self._syncfs = _file_system_sync()
                self._syncfs(fd)
            finally:
                os.close(fd)

    def drop_replayed(self) -> None:
        """After the records were applied and `sync_all` made them durable: the generations read."""
        for path in self.generations():
            path.unlink(missing_ok=True)

    def close(self) -> None:
        with self._checkpointing, self._lock:
            for generation in [*self._sealed, *([self._current] if self._current else [])]:
                os.close(generation.fd)
            self._sealed, self._current = [], None
