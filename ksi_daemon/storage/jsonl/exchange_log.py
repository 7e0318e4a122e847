"""The exchange log `state/exchange-log/N.jsonl`: how an exchange is made durable with one fsync.

With fsync on, an exchange touches up to three files (its response record, its index line and,
for a conversation made for it, the metadata), and syncing each file and its directory costs six
fsyncs for a new conversation, three for a continued one. Instead the exchange is first appended
here as one line and synced; the files are then written without syncing, and every few seconds a
checkpoint syncs the whole file system once (syncfs) and drops the log. After a crash of the
machine, the daemon replays what the log holds before it serves anything (`replay`): each record
writes only what is missing, so a record applied twice changes nothing.

Records are appended under one lock held until the exchange's files are written too, so when a
file write fails the record is still the log's last line and is cut off again: an exchange
reported failed can never come back at replay.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson

from ksi_common.jsonl import read_records
from ksi_daemon.storage.jsonl.files import append_synced, cut_back, storage_failures, sync_path


def _file_system_sync() -> Callable[[int], None]:
    """syncfs(2) on Linux: one call makes every file written on that file system durable; else
    sync(2), which does the same for every file system."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)

        def syncfs(fd: int) -> None:
            if libc.syncfs(fd) != 0:
                code = ctypes.get_errno()
                raise OSError(code, os.strerror(code))

        return syncfs
    return lambda _fd: os.sync()


class ExchangeLog:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._fd: int | None = None  # the generation appended to; opened by the first record after a checkpoint
        self._path: Path | None = None
        self._sealed: list[Path] = []  # generations closed for appends, dropped by the next checkpoint
        self._next = 0
        self._syncfs = _file_system_sync()

    @property
    def pending(self) -> bool:
        """Whether records wait for a checkpoint."""
        return self._fd is not None or bool(self._sealed)

    def generations(self) -> list[Path]:
        """The log's files, oldest first."""
        found = [(int(p.stem), p) for p in self.directory.glob("*.jsonl") if p.stem.isdigit()]
        return [p for _n, p in sorted(found)]

    def records(self) -> list[dict[str, Any]]:
        """Every complete record of every generation, oldest first (a torn last line was never
        acknowledged and is left out)."""
        return [record for path in self.generations() for record in read_records(path)]

    @contextmanager
    def committing(self, record: dict[str, Any]) -> Iterator[None]:
        """Append `record` durably, then run the body (which writes the exchange's files); when
        the body fails, the record is cut off again before the error goes on."""
        payload = orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE, default=str)
        with self._lock:
            fd = self._open()
            start = append_synced(fd, payload)
            try:
                yield
            except BaseException:
                cut_back(fd, start)
                raise

    def _open(self) -> int:
        if self._fd is None:
            self._next = max(self._next, *(int(p.stem) + 1 for p in self.generations()), 0)
            path = self.directory / f"{self._next}.jsonl"
            with storage_failures():
                self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                sync_path(self.directory)  # found again after a crash
            self._path = path
            self._next += 1
        return self._fd

    def checkpoint(self) -> None:
        """Make every file written so far durable, then drop the records that covered them
        (blocking). Records appended meanwhile go to a new generation and wait for the next."""
        with self._lock:
            if self._fd is not None and self._path is not None:
                os.close(self._fd)
                self._sealed.append(self._path)
                self._fd = self._path = None
            sealed = list(self._sealed)
        if not sealed:
            return
        self.sync_all()  # on failure the sealed generations stay for the next checkpoint
        with self._lock:
            for path in sealed:
                path.unlink(missing_ok=True)
                self._sealed.remove(path)

    def sync_all(self) -> None:
        """Every file written on the var dir's file system, durable (blocking)."""
        with storage_failures():
            fd = os.open(self.directory, os.O_RDONLY)
            try:
                self._syncfs(fd)
            finally:
                os.close(fd)

    def drop_replayed(self) -> None:
        """After the records were applied and `sync_all` made them durable: the generations read."""
        for path in self.generations():
            path.unlink(missing_ok=True)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = self._path = None
