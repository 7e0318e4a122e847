"""Exchanges by chained digest for the JSONL store: `state/digests.jsonl`, an append-only log
read into a dict on the first lookup, so a lookup never depends on how many conversations exist.

It is derived data: every line repeats what an index line already holds. One line is appended,
unsynced, after each indexed exchange (a `{"d", "c", "n"}` line per digest); a move and a delete
append one line each (`{"move", "to"}`, `{"drop"}`), replayed in order when the log is read. The
log is rebuilt from every index when it is missing or its first line is not its header (remove the
file to rebuild it); a torn line is skipped. A line a crash kept from the disk leaves that exchange
unfound: a history ending there is taken for one ending an exchange earlier and continues in a
fork made there, never in a wrong conversation.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import orjson
import structlog

from ksi_common.errors import KsiError
from ksi_common.records import IndexEntry, read_index
from ksi_daemon.storage.jsonl.files import jsonl, replace_file

log = structlog.get_logger("ksi.storage.digests")

HEADER = {"v": 1, "kind": "ksi.digests"}


Table = dict[str, set[tuple[str, int]]]  # digest -> (conversation, n)


class DigestIndex:
    def __init__(self, path: Path, conversations_dir: Path) -> None:
        self.path = path
        self.conversations_dir = conversations_dir
        # appends come from several writer threads (or the loop); held only for a write, never
        # for the first read of the log, which waits on `_loading` instead
        self._lock = threading.Lock()
        self._loading = threading.Lock()
        self._table: Table | None = None
        self._of: dict[str, set[str]] = {}  # conversation -> its digests (for moves and deletes)
        self._meanwhile: list[dict[str, Any]] | None = None  # appended while the log is read
        self._fd: int | None = None

    def record(self, conversation_id: str, entries: list[IndexEntry]) -> None:
        """Note the digests of newly indexed exchanges (those that have one)."""
        lines = [{"d": e.digest, "c": conversation_id, "n": e.n} for e in entries if e.digest]
        if lines:
            self._append(lines)

    def moved(self, conversation_id: str, new_id: str) -> None:
        self._append([{"move": conversation_id, "to": new_id}])

    def dropped(self, conversation_id: str) -> None:
        self._append([{"drop": conversation_id}])

    @property
    def loaded(self) -> bool:
        return self._table is not None

    def find(self, digest: str) -> list[tuple[str, int]]:
        """Blocking on the first call (the log is read, or rebuilt); a dict lookup after it."""
        if self._table is None:
            self._load()
        with self._lock:
            assert self._table is not None
            return sorted(self._table.get(digest, ()))

    def prepare(self) -> None:
        """At open: a var dir with no index yet starts its log now; one with indexes and no log
        rebuilds it on the first lookup (not on the way to serving)."""
        has_index = self.conversations_dir.is_dir() and next(self.conversations_dir.glob("*.jsonl"), None)
        if not self.path.exists() and not has_index:
            self._write_whole([HEADER])

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    # -- the log ------------------------------------------------------------------
    def _append(self, lines: list[dict[str, Any]]) -> None:
        with self._lock:
            if self._table is not None:
                for line in lines:
                    _apply(self._table, self._of, line)
            elif self._meanwhile is not None:
                self._meanwhile.extend(lines)
            try:
                if self._fd is None:
                    if not self.path.exists():
                        return  # rebuilt from the indexes (which hold these lines) when first needed
                    self._fd = self._open()
                os.write(self._fd, jsonl(lines))
            except OSError as error:
                # called after the exchange's index line, its commit: a full disk must not fail it.
                # Without the file, the next daemon rebuilds the log from the indexes; this one
                # answers from memory once loaded (or rebuilds then)
                log.warning("digest_log_write_failed", reason=str(error)[:200])
                self._drop_file()

    def _drop_file(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        try:
            self.path.unlink(missing_ok=True)
        except OSError:
            log.warning("digest_log_not_removed", path=self.path.name)

    def _open(self) -> int:
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_NOFOLLOW)
        size = os.lseek(fd, 0, os.SEEK_END)
        if size and os.pread(fd, 1, size - 1) != b"\n":
            os.write(fd, b"\n")  # a torn last line stays one bad line, not two
        return fd

    def _load(self) -> None:
        """Read the log (or rebuild it from the indexes) while appends go on: what they add
        meanwhile is kept aside and applied after."""
        with self._loading:
            if self._table is not None:
                return  # another caller loaded it meanwhile
            with self._lock:
                self._meanwhile = []
                try:
                    raw = self.path.read_bytes()
                except FileNotFoundError:
                    raw = b""
            table: Table = {}
            of: dict[str, set[str]] = {}
            lines = raw.split(b"\n")
            try:
                header = orjson.loads(lines[0]) if lines[0] else None
            except orjson.JSONDecodeError:
                header = None
            rebuilt = None if header == HEADER else self._from_indexes(table, of)
            if rebuilt is None:
                for text in lines[1:]:
                    try:
                        line = orjson.loads(text) if text else None
                    except orjson.JSONDecodeError:
                        continue  # torn by a crash
                    if isinstance(line, dict):
                        _apply(table, of, line)
            with self._lock:
                meanwhile, self._meanwhile = self._meanwhile or [], None
                for line in meanwhile:
                    _apply(table, of, line)
                if rebuilt is not None:
                    if self._fd is not None:  # appends went to the file being replaced
                        os.close(self._fd)
                        self._fd = None
                    self._write_whole([HEADER, *rebuilt, *meanwhile])
                    log.info("digest_index_rebuilt", exchanges=len(rebuilt))
                self._table, self._of = table, of

    def _from_indexes(self, table: Table, of: dict[str, set[str]]) -> list[dict[str, Any]]:
        """Every index's digests, applied to `table`: the lines of a fresh log."""
        out: list[dict[str, Any]] = []
        for index in sorted(self.conversations_dir.glob("*.jsonl")) if self.conversations_dir.is_dir() else []:
            conversation_id = index.stem
            for entry in read_index(index):
                if entry.digest:
                    line = {"d": entry.digest, "c": conversation_id, "n": entry.n}
                    _apply(table, of, line)
                    out.append(line)
        return out

    def _write_whole(self, lines: list[dict[str, Any]]) -> None:
        """A fresh log; when it cannot be written (a full disk), the lookups this run makes are
        answered from memory and the next run rebuilds it."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            replace_file(self.path, jsonl(lines))
        except (KsiError, OSError) as error:
            log.warning("digest_log_write_failed", reason=str(error)[:200])


def _apply(table: Table, of: dict[str, set[str]], line: dict[str, Any]) -> None:
    """One log line: an exchange's digest, a conversation moved to another id, or one deleted."""
    if "d" in line:
        digest, conversation_id, n = line.get("d"), line.get("c"), line.get("n")
        if isinstance(digest, str) and isinstance(conversation_id, str) and isinstance(n, int):
            table.setdefault(digest, set()).add((conversation_id, n))
            of.setdefault(conversation_id, set()).add(digest)
    elif "move" in line:
        old, new = str(line.get("move")), str(line.get("to"))
        for digest in of.pop(old, set()):
            held = table.get(digest, set())
            for match in [m for m in held if m[0] == old]:
                held.discard(match)
                held.add((new, match[1]))
            of.setdefault(new, set()).add(digest)
    elif "drop" in line:
        gone = str(line.get("drop"))
        for digest in of.pop(gone, set()):
            held = table.get(digest, set())
            for match in [m for m in held if m[0] == gone]:
                held.discard(match)
            if not held:
                table.pop(digest, None)
