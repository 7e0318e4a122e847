"""Exchanges by chained digest for the JSONL store: `state/digests.jsonl`, an append-only log
read into a table on the first lookup, so a lookup never depends on how many conversations exist.

It is derived data: every line repeats what an index line already holds. One line is appended,
unsynced, after each indexed exchange (a `{"d", "c", "n"}` line per digest); a move and a delete
append one line each (`{"move", "to"}`, `{"drop"}`), replayed in order when the log is read. The
log is rebuilt from every index when it is missing, unreadable or its first line is not its header
(remove the file to rebuild it; a directory in its place is moved aside); a torn line is skipped.
Every answer is checked against the conversation it names before it is used. A line a crash kept
from the disk leaves that exchange unfound: a history ending there is taken for one ending an
exchange earlier and continues in a fork made there, never in a wrong conversation.

What the table holds is bounded per exchange: the first 16 bytes of its digest (a lookup's answer
is checked against the conversation it names) and the exchange's number with the conversation (or
the set of conversations) holding it, each conversation one shared object (a move renames it, a
delete empties it) rather than its id repeated per exchange, and no map back from conversations
to digests. The first read compacts the log (moves applied, deleted conversations and repeated
lines left out) when a quarter or more of its lines say nothing now. Appends never wait for a
read or a rebuild: the whole file is written aside and only the lines appended meanwhile are
added under the lock, before it takes the log's place.
"""

from __future__ import annotations

import itertools
import os
import threading
import uuid
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path
from typing import Any

import orjson
import structlog

from ksi_common.errors import KsiError
from ksi_common.records import IndexEntry, read_index
from ksi_daemon.storage.jsonl.files import jsonl, replace_file

log = structlog.get_logger("ksi.storage.digests")

HEADER = {"v": 1, "kind": "ksi.digests"}
KEY_HEX = 32  # hex digits of a digest the table keys on (16 bytes: collisions are not a concern)
WRITE_BATCH = 10_000  # lines of a rewritten log serialised at once
GARBAGE_SHARE = 4  # the first read compacts a log when a quarter of its lines or more say nothing now


class _Holder:
    """One conversation as the table names it: renamed by a move, emptied by a delete."""

    __slots__ = ("conversation_id",)

    def __init__(self, conversation_id: str | None) -> None:
        self.conversation_id = conversation_id


class _Shared:
    """The exchange of a digest several conversations hold (the same history imported twice, the
    first turn of many): a set, so the thousandth is added as cheaply as the second."""

    __slots__ = ("holders", "n")

    def __init__(self, n: int, holders: set[_Holder]) -> None:
        self.n = n
        self.holders = holders


# digest key -> (n, holder), or its exchange's number and holders when several hold it (a chained
# digest fixes its exchange's number)
Table = dict[bytes, "tuple[int, _Holder] | _Shared"]


def _held(value: tuple[int, _Holder] | _Shared) -> tuple[int, Collection[_Holder]]:
    return (value.n, value.holders) if isinstance(value, _Shared) else (value[0], (value[1],))


def _key(digest: str) -> bytes:
    try:
        return bytes.fromhex(digest[:KEY_HEX])
    except ValueError:  # not hex (a damaged line): still a key of its own
        return digest[:KEY_HEX].encode()


class _Replay:
    """The table being built from lines, with the holder of every live conversation."""

    def __init__(self) -> None:
        self.table: Table = {}
        self.holders: dict[str, _Holder] = {}
        self.lines = 0  # digest lines applied, repeated ones included
        self.changes = 0  # moves and deletes applied

    def apply(self, line: dict[str, Any]) -> None:
        """One log line: an exchange's digest, a conversation moved to another id, or one deleted."""
        if "d" in line:
            digest, conversation_id, n = line.get("d"), line.get("c"), line.get("n")
            if not (isinstance(digest, str) and isinstance(conversation_id, str) and isinstance(n, int)):
                return
            self.lines += 1
            holder = self.holders.get(conversation_id)
            if holder is None:
                holder = self.holders[conversation_id] = _Holder(conversation_id)
            key = _key(digest)
            held = self.table.get(key)
            if held is None:
                self.table[key] = (n, holder)
            elif isinstance(held, _Shared):
                held.holders.add(holder)
            elif held[1] is not holder:
                self.table[key] = _Shared(held[0], {held[1], holder})
        elif "move" in line:
            self.changes += 1
            holder = self.holders.pop(str(line.get("move")), None)
            if holder is not None:
                new_id = str(line.get("to"))
                holder.conversation_id = new_id
                self.holders[new_id] = holder
        elif "drop" in line:
            self.changes += 1
            holder = self.holders.pop(str(line.get("drop")), None)
            if holder is not None:
                holder.conversation_id = None

    def live(self) -> int:
        """The (exchange, conversation) pairs of live conversations the table holds."""
        return sum(1 for value in self.table.values() for holder in _held(value)[1]
                   if holder.conversation_id is not None)

    def compacted(self) -> Iterator[dict[str, Any]]:
        """The lines of a log holding exactly this table's live pairs."""
        for key, value in self.table.items():
            n, holders = _held(value)
            for holder in holders:
                if holder.conversation_id is not None:
                    yield {"d": key.hex(), "c": holder.conversation_id, "n": n}


class DigestIndex:
    def __init__(self, path: Path, conversations_dir: Path) -> None:
        self.path = path
        self.conversations_dir = conversations_dir
        # appends come from several writer threads (or the loop); held only for a write or a
        # table update, never for reading or rewriting the whole log (`_loading` serialises those)
        self._lock = threading.Lock()
        self._loading = threading.Lock()
        self._replay: _Replay | None = None
        self._meanwhile: list[dict[str, Any]] | None = None  # appended while the log is read or rewritten
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
        return self._replay is not None

    def find(self, digest: str) -> list[tuple[str, int]]:
        """Blocking on the first call (the log is read, or rebuilt); a dict lookup after it."""
        if self._replay is None:
            self._load()
        with self._lock:
            assert self._replay is not None
            table = self._replay.table
            key = _key(digest)
            value = table.get(key)
            if value is None:
                return []
            n, holders = _held(value)
            live = [h for h in holders if h.conversation_id is not None]
            if len(live) != len(holders):  # deleted since: their entries go now
                if not live:
                    del table[key]
                else:
                    table[key] = (n, live[0]) if len(live) == 1 else _Shared(n, set(live))
            return sorted((str(h.conversation_id), n) for h in live)

    def prepare(self) -> None:
        """At open: a var dir with no index yet starts its log now; one with indexes and no log
        rebuilds it on the first lookup (not on the way to serving)."""
        has_index = self.conversations_dir.is_dir() and next(self.conversations_dir.glob("*.jsonl"), None)
        if not self.path.exists() and not has_index:
            self._replace_whole([HEADER])

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    # -- the log ------------------------------------------------------------------
    def _append(self, lines: list[dict[str, Any]]) -> None:
        with self._lock:
            if self._meanwhile is not None:
                self._meanwhile.extend(lines)
            if self._replay is not None and self._meanwhile is None:
                for line in lines:
                    self._replay.apply(line)
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
        meanwhile is kept aside, applied after, and added to a rewritten log before it is swapped in."""
        with self._loading:
            if self._replay is not None:
                return  # another caller loaded it meanwhile
            with self._lock:
                self._meanwhile = []
                try:
                    raw = self.path.read_bytes()
                except FileNotFoundError:
                    raw = b""
                except OSError as error:  # a directory in its place, say: rebuilt as a damaged log is
                    log.warning("digest_log_unreadable", reason=str(error)[:200])
                    raw = b""
            replay = _Replay()
            lines = raw.split(b"\n")
            try:
                header = orjson.loads(lines[0]) if lines[0] else None
            except orjson.JSONDecodeError:
                header = None
            rebuilt = header != HEADER
            if rebuilt:
                self._from_indexes(replay)
            else:
                for text in lines[1:]:
                    try:
                        line = orjson.loads(text) if text else None
                    except orjson.JSONDecodeError:
                        continue  # torn by a crash
                    if isinstance(line, dict):
                        replay.apply(line)
            live = replay.live()
            # lines that say nothing now: repeated ones, those of deleted conversations, moves
            garbage = replay.lines - live + replay.changes
            rewrite = rebuilt or garbage * GARBAGE_SHARE > live
            if rewrite:  # written aside, appends going on meanwhile
                self._write_aside(itertools.chain([HEADER], replay.compacted()))
            with self._lock:
                meanwhile, self._meanwhile = self._meanwhile or [], None
                for line in meanwhile:
                    replay.apply(line)
                if rewrite:
                    self._swap_in(meanwhile)
                    log.info("digest_index_rebuilt" if rebuilt else "digest_index_compacted", exchanges=live)
                self._replay = replay

    def _from_indexes(self, replay: _Replay) -> None:
        """Every index's digests, applied to `replay`."""
        for index in sorted(self.conversations_dir.glob("*.jsonl")) if self.conversations_dir.is_dir() else []:
            conversation_id = index.stem
            for entry in read_index(index):
                if entry.digest:
                    replay.apply({"d": entry.digest, "c": conversation_id, "n": entry.n})

    @property
    def _aside(self) -> Path:
        return self.path.with_name(self.path.name + ".new")

    def _write_aside(self, lines: Iterable[dict[str, Any]]) -> None:
        """The whole log beside it, written a batch at a time (never all of it in memory at once)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self._aside, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            try:
                iterator = iter(lines)
                while batch := list(itertools.islice(iterator, WRITE_BATCH)):
                    os.write(fd, jsonl(batch))
            finally:
                os.close(fd)
        except OSError as error:
            log.warning("digest_log_write_failed", reason=str(error)[:200])
            self._aside.unlink(missing_ok=True)

    def _swap_in(self, meanwhile: list[dict[str, Any]]) -> None:
        """Under the lock: the log written aside, with the lines appended since, takes the log's
        place. When it cannot, the lookups this run makes are answered from memory and the next
        run rebuilds the log (the old one is removed: it may lack lines or hold moved ones)."""
        try:
            if meanwhile:
                fd = os.open(self._aside, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW)
                try:
                    os.write(fd, jsonl(meanwhile))
                finally:
                    os.close(fd)
            if self._fd is not None:  # appends went to the file being replaced
                os.close(self._fd)
                self._fd = None
            self._clear_place()
            os.replace(self._aside, self.path)
        except OSError as error:
            log.warning("digest_log_write_failed", reason=str(error)[:200])
            self._drop_file()

    def _clear_place(self) -> None:
        """A directory in the log's place cannot be replaced by a file: it is moved aside under a
        name of its own, kept for whoever put it there, so the rebuilt log takes its place."""
        if self.path.is_dir() and not self.path.is_symlink():
            aside = self.path.with_name(f"{self.path.name}.damaged-{uuid.uuid4().hex[:12]}")
            os.rename(self.path, aside)
            log.warning("digest_log_set_aside", moved_to=aside.name)

    def _replace_whole(self, lines: list[dict[str, Any]]) -> None:
        """A fresh log; when it cannot be written (a full disk), the next run rebuilds it."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            replace_file(self.path, jsonl(lines))
        except (KsiError, OSError) as error:
            log.warning("digest_log_write_failed", reason=str(error)[:200])
