"""Conversations in files: the index `logs/conversations/ID.jsonl` (append-only) and the metadata
`state/conversations/ID.json` (small, replaced whole); the `ConversationStore` port.

One daemon owns a var dir (its lock file), so the head of each index this daemon touched is kept
in memory: the conditional append compares against it instead of re-reading the file.

Metadata that an exchange changed only in its running totals is not rewritten for it: the index
and response records hold those totals too, and every reader counts in the exchanges a saved file
lags by (`ksi_common.tallies`). The file is rewritten when its totals lag by TALLY_LAG_SAVED
exchanges (so a reader never counts more) and at close. Rewriting it cost more CPU than any other
part of storing an exchange: the rename over the old file frees that file's blocks (on a file
system mounted with `discard`, a discard request sent and waited for) and starts the new file's
writeback at once.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import orjson
import structlog

from ksi_common.errors import KsiError
from ksi_common.ids import is_safe_id
from ksi_common.jsonl import iter_lines_reversed
from ksi_common.layout import VarLayout
from ksi_common.reading import JsonlReader
from ksi_common.records import IndexEntry, parse_index_line, read_index, read_index_tail
from ksi_common.tallies import caught_up
from ksi_daemon.storage.jsonl.digest_index import DigestIndex
from ksi_daemon.storage.jsonl.exchange_log import ExchangeLog
from ksi_daemon.storage.jsonl.files import (
    append_lines,
    jsonl,
    publish_new,
    read_json,
    refused_link,
    replace_file,
    replace_json,
    storage_failures,
    write_new,
)
from ksi_daemon.storage.jsonl.writer_threads import WriterThreads
from ksi_daemon.storage.models import ConversationMeta
from ksi_daemon.storage.ports import ConversationExists, DigestMatch, ExchangeConflict, StoredTail

T = TypeVar("T")
log = structlog.get_logger("ksi.storage.conversations")
IMPORTING = ".importing"  # an imported index waits under this suffix until its metadata exists
TALLY_LAG_SAVED = 32  # exchanges a metadata file's totals may lag by before it is rewritten
RETRY_DELAY = 1.0  # seconds before metadata that could not be written (a full disk) is tried again
CHECKPOINT_DELAY = 2.0  # seconds exchanges wait in the exchange log before their files are synced
REMEMBERED = 4096  # conversations whose saved metadata (and lagging totals) are kept in memory
WRITER_THREADS = 4  # synced writes at once: concurrent exchanges' fsyncs overlap
IMPORT_BATCH = 500  # an import's response files written between two syncs of the file system


class JsonlConversations(JsonlReader):
    """The conversation store over files; reads are the inspection commands' reads."""

    def __init__(self, layout: VarLayout, fsync: bool) -> None:
        super().__init__(layout)
        self.layout = layout
        self.fsync = fsync
        # with fsync on, an exchange is durable by its exchange log record; read at open either way
        self.log = ExchangeLog(layout.exchange_log_dir)
        self.digests = DigestIndex(layout.state_dir / "digests.jsonl", layout.conversations_dir)
        self._writers = WriterThreads(WRITER_THREADS, "ksi-synced-writes")
        self._checkpoint_timer: asyncio.TimerHandle | None = None
        self._checkpointing: asyncio.Task[None] | None = None
        self._heads: dict[str, int] = {}  # conversation id -> last indexed n, once known
        self._saved: dict[str, ConversationMeta] = {}  # the metadata as its file holds it, newest last
        # newer than its file only in its totals: kept to answer from, written at close; one
        # forgotten (over REMEMBERED) is counted from the records again, as any reader does
        self._lagging: dict[str, ConversationMeta] = {}
        self._unwritten: dict[str, ConversationMeta] = {}  # its write failed: retried until it succeeds
        self._meta_lock = threading.Lock()  # one metadata write at a time: a late save never wins
        self._importing: set[str] = set()  # ids an import is writing: a second import of one waits
        self._import_turns = threading.Condition()
        # imports of more than one batch take turns (small ones never wait for them), so large
        # imports cannot take every thread `asyncio.to_thread` hands the reads to
        self._large_imports = asyncio.Semaphore(1)
        self._save_timer: asyncio.TimerHandle | None = None
        self._saving: asyncio.Task[None] | None = None
        # created for a request, unsynced: the metadata goes into its first exchange's log record
        self._unlogged: dict[str, dict[str, Any]] = {}

    @property
    def shared(self) -> bool:
        return False  # the var dir's lock keeps every other daemon away

    async def _write(self, work: Callable[[], T]) -> T:
        """Unsynced writes of a few small lines are cheaper on the loop than a hop to a thread."""
        if not self.fsync:
            return work()
        return await self._writers.run(work)

    # -- existence and metadata ---------------------------------------------
    def _exists(self, conversation_id: str) -> bool:
        return self.layout.meta_file(conversation_id).exists() or self.layout.index_file(conversation_id).exists()

    async def exists(self, conversation_id: str) -> bool:
        return await asyncio.to_thread(self._exists, conversation_id)

    def _pending(self, conversation_id: str) -> ConversationMeta | None:
        """The metadata newer than its file, if any."""
        return self._unwritten.get(conversation_id) or self._lagging.get(conversation_id)

    def _load_meta(self, conversation_id: str) -> ConversationMeta | None:
        pending = self._pending(conversation_id)
        if pending is not None:
            return pending
        path = self.layout.meta_file(conversation_id)
        try:
            saved_at = os.stat(path).st_mtime_ns
        except FileNotFoundError:
            saved_at = 0
        raw = read_json(path)
        if raw is None:
            if self.layout.index_file(conversation_id).exists():
                return ConversationMeta(conversation_id=conversation_id)  # an index without metadata
            return None
        if not isinstance(raw, dict):
            return ConversationMeta.model_validate(raw)  # refused with the reason
        current = caught_up(self.layout, raw, saved_at)  # totals of exchanges indexed after the last save
        meta = ConversationMeta.model_validate(current)
        with self._meta_lock:
            if current is raw:
                self._remember(meta)
            else:  # the file lags: what it holds is what the next exchange's lag counts from
                self._remember(ConversationMeta.model_validate(raw))
                self._lag(meta)
        return meta

    async def load_meta(self, conversation_id: str) -> ConversationMeta | None:
        pending = self._pending(conversation_id)
        if pending is not None:
            return pending
        return await asyncio.to_thread(self._load_meta, conversation_id)

    def _remember(self, meta: ConversationMeta) -> None:
        """`meta` as its file now holds it (under the metadata lock)."""
        self._saved.pop(meta.conversation_id, None)
        self._saved[meta.conversation_id] = meta
        self._lagging.pop(meta.conversation_id, None)
        if len(self._saved) > REMEMBERED:  # a forgotten one is saved whole on its next exchange
            forgotten = next(iter(self._saved))
            del self._saved[forgotten]
            self._lagging.pop(forgotten, None)

    def _lag(self, meta: ConversationMeta) -> None:
        """`meta` newer than its file in its totals only (under the metadata lock)."""
        if meta.conversation_id in self._unwritten:  # an older version waits to be written: this one does
            self._unwritten[meta.conversation_id] = meta
            return
        self._lagging.pop(meta.conversation_id, None)
        self._lagging[meta.conversation_id] = meta
        if len(self._lagging) > REMEMBERED:
            del self._lagging[next(iter(self._lagging))]

    def _forget(self, conversation_id: str) -> None:
        self._unlogged.pop(conversation_id, None)
        with self._meta_lock:
            self._saved.pop(conversation_id, None)
            self._lagging.pop(conversation_id, None)
            self._unwritten.pop(conversation_id, None)

    def _write_meta(self, meta: ConversationMeta) -> None:
        path = self.layout.meta_file(meta.conversation_id)
        value = meta.model_dump(mode="json")
        try:
            replace_json(path, value)
        except FileNotFoundError:  # the first conversation of a fresh var dir
            path.parent.mkdir(parents=True, exist_ok=True)
            replace_json(path, value)

    def _save_meta(self, meta: ConversationMeta) -> None:
        self._commit_meta(meta, lag=False)

    def _commit_meta(self, meta: ConversationMeta, lag: bool = True) -> None:
        """Write `meta`; with `lag`, leave the file as it is while it differs only in totals
        that lag by fewer than TALLY_LAG_SAVED exchanges."""
        with self._meta_lock:
            saved = self._saved.get(meta.conversation_id)
            if (lag and saved is not None and meta.exchanges - saved.exchanges < TALLY_LAG_SAVED
                    and saved.same_but_tallies(meta)):
                self._lag(meta)
                return
            self._write_meta(meta)
            self._unwritten.pop(meta.conversation_id, None)
            self._remember(meta)

    def save_waiting(self, lagging: bool = True) -> None:
        """Write every metadata that could not be written and (with `lagging`) every one whose
        totals lag (blocking); one that fails waits for the next try."""
        with self._meta_lock:
            waiting = {**self._lagging, **self._unwritten} if lagging else dict(self._unwritten)
            for conversation_id, meta in waiting.items():
                try:
                    self._write_meta(meta)
                except KsiError as error:
                    self._unwritten[conversation_id] = meta
                    log.warning("metadata_write_failed", conversation_id=conversation_id, code=error.code)
                else:
                    self._unwritten.pop(conversation_id, None)
                    self._remember(meta)

    def _save_later(self) -> None:
        if self._save_timer is None:
            self._save_timer = asyncio.get_running_loop().call_later(RETRY_DELAY, self._save_now)

    def _save_now(self) -> None:
        self._save_timer = None
        if self._saving is None or self._saving.done():  # a slow save still running takes the rest after it
            self._saving = asyncio.ensure_future(asyncio.to_thread(self.save_waiting, False))
        else:
            self._save_later()

    async def close(self) -> None:
        await asyncio.to_thread(self._writers.close)  # writes a cancelled caller left running finish first
        if self._save_timer is not None:
            self._save_timer.cancel()
            self._save_timer = None
        if self._saving is not None:
            await self._saving
        await asyncio.to_thread(self.save_waiting)
        if self._checkpoint_timer is not None:
            self._checkpoint_timer.cancel()
            self._checkpoint_timer = None
        try:
            await self.checkpoint()
        except KsiError as error:  # the records stay: the next start writes from them what is missing
            log.warning("checkpoint_failed", code=error.code, reason=error.message[:200])
        self.log.close()
        self.digests.close()

    # -- the exchange log --------------------------------------------------------
    def replay_log(self) -> None:
        """Exchanges a crash of the machine may have kept from their files, written again from
        the exchange log (blocking; at open, before anything is served)."""
        records = self.log.records()
        for record in records:
            self._apply(record)
        if records:
            self.log.sync_all()
            log.info("exchange_log_replayed", records=len(records))
        self.log.drop_replayed()

    def _apply(self, record: dict[str, Any]) -> None:
        """Write what of one logged exchange is missing: applied twice, it changes nothing."""
        conversation_id = str(record.get("conversation_id") or "")
        entry = record.get("entry")
        if not is_safe_id(conversation_id) or not isinstance(entry, dict):
            return
        meta = record.get("meta")
        if isinstance(meta, dict) and not self.layout.meta_file(conversation_id).exists():
            replace_json(self.layout.meta_file(conversation_id), meta)
        response = record.get("response")
        response_id = str(entry.get("response_id") or "")
        if isinstance(response, list) and is_safe_id(response_id):
            path = self.layout.response_file(response_id)
            payload = jsonl(response)
            try:
                whole = path.read_bytes() == payload
            except FileNotFoundError:
                whole = False
            if not whole:
                replace_file(path, payload)
        n = int(entry.get("n") or 0)
        if n > self._head(conversation_id):
            append_lines(self.layout.index_file(conversation_id), jsonl([entry]), fsync=False)
            self._heads[conversation_id] = n
        digest = entry.get("digest")
        if isinstance(digest, str):  # its unsynced lookup line may be lost with the index line's sync
            self.digests.record(conversation_id, [IndexEntry(n=n, response_id=response_id, digest=digest)])

    async def checkpoint(self) -> None:
        """Sync the files of the exchanges logged so far and drop their records."""
        if self._checkpointing is not None and not self._checkpointing.done():
            await self._checkpointing
        if self.log.pending:
            await asyncio.to_thread(self.log.checkpoint)

    def _checkpoint_later(self) -> None:
        if self._checkpoint_timer is None:
            self._checkpoint_timer = asyncio.get_running_loop().call_later(CHECKPOINT_DELAY, self._checkpoint_now)

    def _checkpoint_now(self) -> None:
        self._checkpoint_timer = None
        self._checkpointing = asyncio.ensure_future(self._background_checkpoint())

    async def _background_checkpoint(self) -> None:
        try:
            await asyncio.to_thread(self.log.checkpoint)
        except KsiError as error:  # the records stay; the next exchange schedules another try
            log.warning("checkpoint_failed", code=error.code, reason=error.message[:200])

    async def metas(self, conversation_ids: list[str]) -> list[dict[str, Any] | None]:
        found = await super().metas(conversation_ids)
        return [self._waiting_record(c) or meta for c, meta in zip(conversation_ids, found, strict=True)]

    async def all_metas(self) -> list[dict[str, Any]]:
        found = await super().all_metas()
        return [self._waiting_record(str(meta.get("conversation_id"))) or meta for meta in found]

    def _waiting_record(self, conversation_id: str) -> dict[str, Any] | None:
        pending = self._pending(conversation_id)
        return pending.model_dump(mode="json") if pending is not None else None

    async def save_meta(self, meta: ConversationMeta) -> None:
        await self._write(lambda: self._save_meta(meta))

    def _create(self, meta: ConversationMeta, sync: bool) -> dict[str, Any]:
        """Write the metadata of a new conversation; returns it as written."""
        if self.layout.index_file(meta.conversation_id).exists():
            raise ConversationExists(meta.conversation_id)
        path = self.layout.meta_file(meta.conversation_id)
        record = meta.model_dump(mode="json")
        payload = orjson.dumps(record, option=orjson.OPT_INDENT_2)
        try:
            try:
                # complete when visible: a reader racing this create never finds an empty file
                publish_new(path, payload, sync)
            except FileNotFoundError:  # the first conversation of a fresh var dir
                path.parent.mkdir(parents=True, exist_ok=True)
                publish_new(path, payload, sync)
        except FileExistsError:
            raise ConversationExists(meta.conversation_id) from None
        self._heads[meta.conversation_id] = 0
        with self._meta_lock:
            self._remember(meta)
        return record

    async def create(self, meta: ConversationMeta, *, durable_with_first_exchange: bool = False) -> None:
        if durable_with_first_exchange and self.fsync:
            # written now, unsynced (no hop to a thread): its first exchange's log record holds it
            self._unlogged[meta.conversation_id] = self._create(meta, sync=False)
            return
        await self._write(lambda: self._create(meta, self.fsync))

    # -- the index -------------------------------------------------------------
    def _head(self, conversation_id: str) -> int:
        known = self._heads.get(conversation_id)
        if known is not None:
            return known
        head = 0
        for raw in iter_lines_reversed(self.layout.index_file(conversation_id)):
            entry = parse_index_line(raw, 0)
            if entry is None:
                continue
            if entry.n == 0:  # a legacy bare id: numbering needs the whole file
                entries = read_index(self.layout.index_file(conversation_id))
                head = entries[-1].n if entries else 0
            else:
                head = entry.n
            break
        self._heads[conversation_id] = head
        return head

    async def head(self, conversation_id: str) -> int:
        if conversation_id in self._heads:
            return self._heads[conversation_id]
        return await asyncio.to_thread(self._head, conversation_id)

    async def moved_since(self, conversation_id: str, head: int, token_budget: int) -> StoredTail | None:
        if await self.head(conversation_id) == head:
            return None
        meta = await self.load_meta(conversation_id)
        if meta is None:
            return StoredTail(None, [], 0)
        entries, total = await self.read_tail(conversation_id, token_budget)
        return StoredTail(meta, entries, total)

    def _append(self, conversation_id: str, entry: IndexEntry, response: list[dict[str, Any]] | None,
                meta: ConversationMeta | None) -> bool:
        """Response record, index line, metadata; True when the metadata could not be written (it is
        tried again within a second)."""
        head = self._head(conversation_id)
        if entry.n <= head:
            raise ExchangeConflict(conversation_id, entry.n, head)
        line = entry.to_record()
        if self.fsync:
            # durable by one synced log record; the files are synced in bulk at the next checkpoint
            record: dict[str, Any] = {"v": 1, "conversation_id": conversation_id, "entry": line,
                                      "response": response}
            created = self._unlogged.get(conversation_id)
            if created is not None:
                record["meta"] = created
            with self.log.committing(entry.response_id, record):
                self._write_exchange(conversation_id, entry, line, response)
            self._unlogged.pop(conversation_id, None)
        else:
            self._write_exchange(conversation_id, entry, line, response)
        self._heads[conversation_id] = entry.n
        if meta is None:
            return False
        # The index line is the commit: from here the exchange is done, so a full disk now
        # must not report it failed (it would stay indexed while the caller gives its number
        # again). The metadata is tried again within a second (and at close), else a change no
        # later exchange makes again would be lost.
        try:
            self._commit_meta(meta)
        except KsiError as error:
            log.warning("metadata_write_failed", conversation_id=conversation_id, code=error.code,
                        exchange=entry.n)
            with self._meta_lock:
                self._unwritten[conversation_id] = meta
            return True
        return False

    def _write_exchange(self, conversation_id: str, entry: IndexEntry, line: dict[str, Any],
                        response: list[dict[str, Any]] | None) -> None:
        if response is not None:
            path = self.layout.response_file(entry.response_id)
            try:  # the response record first: a reader never finds an index line without it
                write_new(path, jsonl(response), fsync=False)
            except FileExistsError:  # an earlier attempt of this same append wrote it, unless a link is there
                if os.path.islink(path):
                    raise refused_link(path) from None
        append_lines(self.layout.index_file(conversation_id), jsonl([line]), fsync=False)
        self.digests.record(conversation_id, [entry])

    async def append_exchange(self, conversation_id: str, entry: IndexEntry, *,
                              response: list[dict[str, Any]] | None = None,
                              meta: ConversationMeta | None = None) -> None:
        if await self._write(lambda: self._append(conversation_id, entry, response, meta)):
            self._save_later()
        if self.fsync:
            self._checkpoint_later()

    async def read_tail(self, conversation_id: str, token_budget: int) -> tuple[list[IndexEntry], int]:
        return await asyncio.to_thread(read_index_tail, self.layout.index_file(conversation_id), token_budget)

    async def find_digest(self, digest: str) -> list[DigestMatch]:
        # the first lookup reads (or rebuilds) the log off the loop; later ones are a dict lookup
        found = self.digests.find(digest) if self.digests.loaded else await asyncio.to_thread(self.digests.find, digest)
        return [DigestMatch(conversation_id, n) for conversation_id, n in found]

    # -- moves -----------------------------------------------------------------
    def _move(self, conversation_id: str, new_id: str, note: dict[str, Any]) -> list[str]:
        meta = self._load_meta(conversation_id) or ConversationMeta(conversation_id=conversation_id)
        self._forget(conversation_id)  # no later save may write the old id's file again
        meta = meta.model_copy(update={"conversation_id": new_id, "extra": dict(meta.extra)})
        meta.extra.update(note)
        self._save_meta(meta)  # first: a crash after it leaves the old conversation whole, plus a stray copy
        # the summaries go with their exchanges (before the index: a crash between leaves the old
        # conversation without them, and they are written again, never a new one with old ones)
        summaries = self.layout.summaries_file(conversation_id)
        if summaries.exists():
            os.rename(summaries, self.layout.summaries_file(new_id))
        index = self.layout.index_file(conversation_id)
        if index.exists():
            os.rename(index, self.layout.index_file(new_id))
            self.digests.moved(conversation_id, new_id)
        try:
            self.layout.meta_file(conversation_id).unlink()
        except FileNotFoundError:
            pass
        self._heads.pop(conversation_id, None)
        self._heads.pop(new_id, None)
        return self._repoint_forks(conversation_id, new_id)

    def _repoint_forks(self, parent_id: str, new_parent_id: str) -> list[str]:
        changed = []
        for path in sorted(self.layout.conversation_meta_dir.glob("*.json")):
            try:
                raw = read_json(path)
            except ValueError:
                continue
            if not isinstance(raw, dict) or raw.get("parent_id") != parent_id:
                continue
            waiting = self._pending(path.stem)  # its totals may be newer than its file
            meta = (waiting or ConversationMeta.model_validate(raw)).model_copy(update={"parent_id": new_parent_id})
            self._save_meta(meta)
            changed.append(meta.conversation_id)
        return changed

    async def move(self, conversation_id: str, new_id: str, note: dict[str, Any]) -> list[str]:
        await self.checkpoint()  # a replay must never write the old id's exchanges again
        return await asyncio.to_thread(self._move, conversation_id, new_id, note)

    async def adopt(self, conversation_id: str, source_id: str, meta: ConversationMeta, replaced: int = 0) -> bool:
        await self.checkpoint()  # a replay must never write the source's exchanges under its old id
        return await asyncio.to_thread(self._adopt, conversation_id, source_id, meta, replaced)

    def _adopt(self, conversation_id: str, source_id: str, meta: ConversationMeta, replaced: int) -> bool:
        self._heads.pop(conversation_id, None)  # asked of the file itself: another writer may have appended
        if self._head(conversation_id) != replaced or self._load_meta(source_id) is None:
            return False
        entries = self.files.entries(source_id)
        self._forget(source_id)  # no later save may write the source's metadata again
        summaries = self.layout.summaries_file(source_id)
        self.layout.summaries_file(conversation_id).unlink(missing_ok=True)  # those of the replaced exchanges
        if summaries.exists():
            os.rename(summaries, self.layout.summaries_file(conversation_id))
        # the index moves first (over the replaced one): from here the exchanges are the target's;
        # a crash before the records below are repointed leaves those responses unresolved
        index = self.layout.index_file(source_id)
        if index.exists():
            if replaced:
                self.digests.dropped(conversation_id)
            os.rename(index, self.layout.index_file(conversation_id))
            self.digests.moved(source_id, conversation_id)
        for entry in entries:
            self._repoint_response(entry.response_id, source_id, conversation_id)
        self._save_meta(meta)
        self.layout.meta_file(source_id).unlink(missing_ok=True)
        self._heads.pop(source_id, None)
        self._heads.pop(conversation_id, None)
        return True

    def _repoint_response(self, response_id: str, source_id: str, conversation_id: str) -> None:
        """Rewrite a response file whose lines name `source_id` so they name `conversation_id`."""
        path = self.layout.response_file(response_id)
        if not is_safe_id(response_id) or not path.exists():
            return
        lines = [orjson.loads(raw) for raw in path.read_bytes().splitlines() if raw.strip()]
        for line in lines:
            if isinstance(line, dict) and line.get("conversation_id") == source_id:
                line["conversation_id"] = conversation_id
        replace_file(path, jsonl(lines), self.fsync)

    def _delete(self, conversation_id: str) -> list[str]:
        """The index, its summaries, the metadata and the response files of this conversation."""
        # A response file belongs to the conversation whose index lists it. Its lines keep the
        # conversation id they were written under, which after an agent reset names another one.
        self._forget(conversation_id)  # no later save may write its metadata again
        kept = self._indexed_elsewhere(conversation_id)
        layout = self.layout
        paths = [layout.response_file(entry.response_id)
                 for entry in self.files.entries(conversation_id)
                 if is_safe_id(entry.response_id) and entry.response_id not in kept]
        paths += [p for p in self._response_files_of(conversation_id) if p.stem not in kept]
        paths += [layout.index_file(conversation_id), layout.summaries_file(conversation_id),
                  layout.meta_file(conversation_id)]
        removed = []
        for path in dict.fromkeys(paths):
            try:
                path.unlink()
            except FileNotFoundError:
                continue
            removed.append(str(path.relative_to(layout.root)))
        self._heads.pop(conversation_id, None)
        self.digests.dropped(conversation_id)
        return sorted(removed)

    def _indexed_elsewhere(self, conversation_id: str) -> set[str]:
        """Response ids listed by the index of any other conversation."""
        listed: set[str] = set()
        for index in self.layout.conversations_dir.glob("*.jsonl"):
            if index.stem != conversation_id:
                listed.update(entry.response_id for entry in read_index(index))
        return listed

    def _response_files_of(self, conversation_id: str) -> list[Path]:
        """Response files whose lines say they belong to `conversation_id`: indexed exchanges,
        failed requests and calls logged on the conversation's behalf."""
        owned = []
        needle = b'"conversation_id":' + orjson.dumps(conversation_id)
        for path in self.layout.responses_dir.glob("*.jsonl"):
            try:
                with open(path, "rb") as handle:
                    head = handle.read(64 * 1024)
            except OSError:
                continue
            if needle not in head:
                continue
            for raw in head.split(b"\n"):
                try:
                    line = orjson.loads(raw)
                except orjson.JSONDecodeError:
                    continue
                if isinstance(line, dict) and "conversation_id" in line:
                    if line["conversation_id"] == conversation_id:
                        owned.append(path)
                    break
        return owned

    async def discard_unused(self, conversation_id: str) -> bool:
        def work() -> bool:
            self._heads.pop(conversation_id, None)  # asked of the file itself: another writer may have appended
            if self._head(conversation_id):
                return False
            self._forget(conversation_id)
            for path in (self.layout.index_file(conversation_id), self.layout.meta_file(conversation_id)):
                path.unlink(missing_ok=True)
            self._heads.pop(conversation_id, None)
            return True

        return await self._write(work)

    async def delete(self, conversation_id: str) -> list[str]:
        await self.checkpoint()  # a replay must never bring its exchanges back
        return await asyncio.to_thread(self._delete, conversation_id)

    # -- import ------------------------------------------------------------------
    def _pending_index(self, conversation_id: str) -> Path:
        return self.layout.pending_import_file(conversation_id)

    @contextmanager
    def _import_of(self, conversation_id: str) -> Iterator[None]:
        """One import of an id at a time: two imports of one new id would share the hidden index,
        and the one that won the metadata could rename the other's exchanges into place. Imports
        of other ids go on meanwhile."""
        with self._import_turns:
            while conversation_id in self._importing:
                self._import_turns.wait()
            self._importing.add(conversation_id)
        try:
            yield
        finally:
            with self._import_turns:
                self._importing.discard(conversation_id)
                self._import_turns.notify_all()

    def _import(self, meta: ConversationMeta, exchanges: list[tuple[IndexEntry, list[dict[str, Any]]]]) -> None:
        """All of an import or none of it: response files, then the index under a hidden name,
        then the metadata by exclusive create (the commit point), then the index into place. A
        kill before the metadata leaves orphans only; after it, `finish_imports` completes it.

        With fsync on, the files are written unsynced and the file system is synced once per
        IMPORT_BATCH exchanges (the last sync covers the hidden index too): nothing of the import
        is visible before its metadata, so no file needs to be durable on its own. A sync per
        file made a 5,000-exchange import take half a minute."""
        conversation_id = meta.conversation_id
        with self._import_of(conversation_id):
            if self._exists(conversation_id):
                raise ConversationExists(conversation_id)
            written: list[Path] = []
            pending = self._pending_index(conversation_id)
            try:
                for start in range(0, len(exchanges), IMPORT_BATCH):
                    for entry, lines in exchanges[start:start + IMPORT_BATCH]:
                        path = self.layout.response_file(entry.response_id)
                        write_new(path, jsonl(lines), fsync=False)
                        written.append(path)
                    if start + IMPORT_BATCH < len(exchanges) and self.fsync:
                        self.log.sync_all(self.layout.responses_dir)
                with storage_failures():  # a read-only var dir fails here first
                    pending.unlink(missing_ok=True)
                if exchanges:
                    write_new(pending, jsonl([entry.to_record() for entry, _lines in exchanges]), fsync=False)
                if self.fsync:
                    self.log.sync_all(self.layout.responses_dir)  # the last batch and the hidden index
                self._create(meta, self.fsync)
            except BaseException:  # another creator took the id meanwhile, or the disk is full
                _remove_quietly([pending, *written])
                raise
            if exchanges:
                os.rename(pending, self.layout.index_file(conversation_id))
                self.digests.record(conversation_id, [entry for entry, _lines in exchanges])
            self._heads[conversation_id] = exchanges[-1][0].n if exchanges else 0

    def finish_imports(self) -> list[str]:
        """Imports a kill interrupted: with their metadata written they are completed, without
        it the hidden index is dropped (the import never happened). Returns those completed."""
        finished: list[str] = []
        directory = self.layout.conversations_dir
        if not directory.is_dir():
            return finished
        for pending in directory.glob(f".*.jsonl{IMPORTING}"):
            conversation_id = pending.name[1:-len(f".jsonl{IMPORTING}")]
            if self.layout.meta_file(conversation_id).exists() and not self.layout.index_file(conversation_id).exists():
                os.rename(pending, self.layout.index_file(conversation_id))
                self.digests.record(conversation_id, read_index(self.layout.index_file(conversation_id)))
                finished.append(conversation_id)
            else:
                pending.unlink(missing_ok=True)
        return finished

    async def import_conversation(self, meta: ConversationMeta,
                                  exchanges: list[tuple[IndexEntry, list[dict[str, Any]]]]) -> None:
        if len(exchanges) <= IMPORT_BATCH:
            await asyncio.to_thread(self._import, meta, exchanges)
            return
        async with self._large_imports:
            await asyncio.to_thread(self._import, meta, exchanges)


def _remove_quietly(paths: list[Path]) -> None:
    """Take back what a failed import wrote. On a var dir gone read-only the removal fails too:
    the import's own error is the one reported, and what is left is orphans no index names."""
    for path in paths:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("import_cleanup_failed", path=path.name, error=exc.strerror or str(exc))
