"""Reading stored conversations, whatever the backend: the read port shared by the daemon and the
`ksi` inspection commands, its JSONL implementation, and `open_reader`, which picks one by name
(from the table of backends, `ksi_common.storage_backends`).

Client-light: standard library and orjson; a backend that needs a driver imports it lazily, only
when it is the one chosen. The daemon's conversation stores implement this same port, so the
daemon's `conversation:*` events and the inspection commands read through the same code.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any, Protocol

import orjson

from ksi_common.ids import is_safe_id
from ksi_common.layout import VarLayout
from ksi_common.records import IndexEntry, ResponseRecord, read_index, read_response
from ksi_common.storage_backends import backend_named
from ksi_common.summaries import Summary, read_summaries
from ksi_common.tallies import caught_up

SETTLED_NS = 2_000_000_000  # a file time this old can no longer share its tick with a new change


class StoredReader(Protocol):
    """Read-only access to conversations and response records; every method is a coroutine."""

    async def conversation_ids(self) -> list[str]:
        """Every conversation with metadata or an index, sorted."""
        ...

    async def metas(self, conversation_ids: list[str]) -> list[dict[str, Any] | None]:
        """Stored metadata as plain dicts, in the order asked; an index without metadata gets a
        minimal record (exchanges, last activity, models); None when neither exists."""
        ...

    async def all_metas(self) -> list[dict[str, Any]]:
        """The metadata of every conversation, as `metas` gives it (what a listing filters); a
        backend may serve it from a cache of its own as long as every change shows."""
        ...

    async def entries(self, conversation_id: str) -> list[IndexEntry]:
        """Every complete exchange of the conversation's own index, in order (legacy lines too)."""
        ...

    async def responses(self, response_ids: list[str]) -> list[ResponseRecord | None]:
        """Response records in the order asked; None for a missing one (or an unsafe id)."""
        ...

    async def forks_of(self, conversation_id: str) -> list[str]:
        """Conversations whose metadata names this one as their parent, sorted."""
        ...

    async def summaries(self, conversation_id: str) -> list[Summary]:
        """The conversation's own summaries (compaction), oldest first."""
        ...

    async def agent_records(self) -> list[dict[str, Any]]:
        """Every stored agent record (what `agent:spawn` made, as plain dicts), sorted by agent id."""
        ...

    async def aclose(self) -> None:
        """Release what the reader holds (a connection pool); a no-op for files."""
        ...


class JsonlFiles:
    """Blocking reads of the `var/` layout; `JsonlReader` runs them off the loop."""

    def __init__(self, layout: VarLayout) -> None:
        self.layout = layout
        # listing 10,000 conversations re-reads only the metadata files that changed
        self._listed: dict[str, tuple[tuple[int, int, int], dict[str, Any]]] = {}
        self._listed_stamp: tuple[int, int] = (0, 0)  # mtimes of the metadata and index directories
        self._listed_all: list[dict[str, Any]] | None = None

    def conversation_ids(self) -> list[str]:
        ids = {p.stem for p in self.layout.conversations_dir.glob("*.jsonl")}
        ids |= {p.stem for p in self.layout.conversation_meta_dir.glob("*.json")}
        return sorted(i for i in ids if not i.startswith("."))

    def meta(self, conversation_id: str) -> dict[str, Any] | None:
        if not is_safe_id(conversation_id):
            return None
        path = self.layout.meta_file(conversation_id)
        try:
            saved_at = os.stat(path).st_mtime_ns
            raw = orjson.loads(path.read_bytes())
        except FileNotFoundError:
            raw = None
        except orjson.JSONDecodeError:
            raw = {}
        if isinstance(raw, dict) and raw:
            raw.setdefault("conversation_id", conversation_id)
            return caught_up(self.layout, raw, saved_at)  # saved lazily by a running or killed daemon
        index = self.layout.index_file(conversation_id)
        if raw is None and not index.exists():
            return None
        entries = read_index(index)
        return {"conversation_id": conversation_id, "exchanges": len(entries),
                "last_activity": entries[-1].ts if entries else None,
                "models": list(dict.fromkeys(e.model for e in entries if e.model))}

    def all_metas(self) -> list[dict[str, Any]]:
        """Every conversation's metadata; files unchanged since the last call (same mtime, size
        and inode) are not re-read."""
        # Metadata is replaced by rename, which changes its directory. A file system stamps times
        # coarsely (a few ms), so a stamp is trusted only once it is older than SETTLED_NS.
        settled = time.time_ns() - SETTLED_NS
        stamp = (_mtime(self.layout.conversation_meta_dir), _mtime(self.layout.conversations_dir))
        if stamp == self._listed_stamp and self._listed_all is not None and max(stamp) < settled:
            return self._listed_all
        listed: dict[str, tuple[tuple[int, int, int], dict[str, Any]]] = {}
        try:
            with os.scandir(self.layout.conversation_meta_dir) as found:
                for item in found:
                    if not item.name.endswith(".json") or item.name.startswith("."):
                        continue
                    conversation_id = item.name[:-5]
                    try:
                        stat = item.stat()
                    except FileNotFoundError:
                        continue  # deleted meanwhile
                    key = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
                    known = self._listed.get(conversation_id)
                    if known is None or known[0] != key or stat.st_mtime_ns >= settled:
                        meta = self.meta(conversation_id)
                        if meta is None:
                            continue
                        known = (key, meta)
                    listed[conversation_id] = known
        except FileNotFoundError:
            pass
        self._listed = listed
        metas = [meta for _key, meta in listed.values()]
        try:
            with os.scandir(self.layout.conversations_dir) as found:
                for item in found:
                    conversation_id = item.name[:-6]
                    if (item.name.endswith(".jsonl") and not item.name.startswith(".")
                            and conversation_id not in listed):
                        meta = self.meta(conversation_id)  # an index without metadata (older layouts)
                        if meta is not None:
                            metas.append(meta)
        except FileNotFoundError:
            pass
        self._listed_stamp, self._listed_all = stamp, metas
        return metas

    def entries(self, conversation_id: str) -> list[IndexEntry]:
        if not is_safe_id(conversation_id):
            return []
        return read_index(self.layout.index_file(conversation_id))

    def response(self, response_id: str) -> ResponseRecord | None:
        if not is_safe_id(response_id):
            return None
        return read_response(self.layout.response_file(response_id))

    def summaries(self, conversation_id: str) -> list[Summary]:
        if not is_safe_id(conversation_id):
            return []
        return read_summaries(self.layout.summaries_file(conversation_id))

    def forks_of(self, conversation_id: str) -> list[str]:
        forks = []
        for path in self.layout.conversation_meta_dir.glob("*.json"):
            try:
                raw = orjson.loads(path.read_bytes())
            except (OSError, orjson.JSONDecodeError):
                continue
            if isinstance(raw, dict) and raw.get("parent_id") == conversation_id:
                forks.append(path.stem)
        return sorted(forks)

    def agent_records(self) -> list[dict[str, Any]]:
        records = []
        for path in sorted(self.layout.agents_dir.glob("*.json")):
            try:
                raw = orjson.loads(path.read_bytes())
            except (OSError, orjson.JSONDecodeError):
                continue  # a record being replaced is written aside and renamed: never torn
            if isinstance(raw, dict) and "agent_id" in raw:
                records.append(raw)
        return records


class JsonlReader:
    """The read port over a var dir's files (the default backend)."""

    def __init__(self, layout: VarLayout, database_url: str | None = None) -> None:
        self.files = JsonlFiles(layout)

    async def conversation_ids(self) -> list[str]:
        return await asyncio.to_thread(self.files.conversation_ids)

    async def metas(self, conversation_ids: list[str]) -> list[dict[str, Any] | None]:
        return await asyncio.to_thread(lambda: [self.files.meta(c) for c in conversation_ids])

    async def all_metas(self) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self.files.all_metas)

    async def entries(self, conversation_id: str) -> list[IndexEntry]:
        return await asyncio.to_thread(self.files.entries, conversation_id)

    async def responses(self, response_ids: list[str]) -> list[ResponseRecord | None]:
        return await asyncio.to_thread(lambda: [self.files.response(r) for r in response_ids])

    async def forks_of(self, conversation_id: str) -> list[str]:
        return await asyncio.to_thread(self.files.forks_of, conversation_id)

    async def summaries(self, conversation_id: str) -> list[Summary]:
        return await asyncio.to_thread(self.files.summaries, conversation_id)

    async def agent_records(self) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self.files.agent_records)

    async def aclose(self) -> None:
        return None


def _mtime(directory: Path) -> int:
    try:
        return directory.stat().st_mtime_ns
    except FileNotFoundError:
        return 0


def open_reader(storage: str, layout: VarLayout, database_url: str | None = None) -> StoredReader:
    """The reader of backend `storage` (`KSI_STORAGE`), for a var dir or a database."""
    reader_class = backend_named(storage).load("reader")
    return reader_class(layout, database_url)  # type: ignore[no-any-return]
