"""Reading stored conversations, whatever the backend: the read port shared by the daemon and the
`ksi` inspection commands, its JSONL implementation, and the table that picks one by name.

Client-light: standard library and orjson; a backend that needs a driver imports it lazily, only
when it is the one chosen. The daemon's conversation stores implement this same port, so the
daemon's `conversation:*` events and the inspection commands read through the same code.
"""

from __future__ import annotations

import asyncio
import importlib
from typing import Any, Protocol

import orjson

from ksi_common.ids import is_safe_id
from ksi_common.layout import VarLayout
from ksi_common.records import IndexEntry, ResponseRecord, read_index, read_response

STORAGE_NAMES = ("jsonl", "postgres")


class StoredReader(Protocol):
    """Read-only access to conversations and response records; every method is a coroutine."""

    async def conversation_ids(self) -> list[str]:
        """Every conversation with metadata or an index, sorted."""
        ...

    async def metas(self, conversation_ids: list[str]) -> list[dict[str, Any] | None]:
        """Stored metadata as plain dicts, in the order asked; an index without metadata gets a
        minimal record (exchanges, last activity, models); None when neither exists."""
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

    async def aclose(self) -> None:
        """Release what the reader holds (a connection pool); a no-op for files."""
        ...


class JsonlFiles:
    """Blocking reads of the `var/` layout; `JsonlReader` runs them off the loop."""

    def __init__(self, layout: VarLayout) -> None:
        self.layout = layout

    def conversation_ids(self) -> list[str]:
        ids = {p.stem for p in self.layout.conversations_dir.glob("*.jsonl")}
        ids |= {p.stem for p in self.layout.conversation_meta_dir.glob("*.json")}
        return sorted(i for i in ids if not i.startswith("."))

    def meta(self, conversation_id: str) -> dict[str, Any] | None:
        if not is_safe_id(conversation_id):
            return None
        path = self.layout.meta_file(conversation_id)
        try:
            raw = orjson.loads(path.read_bytes())
        except FileNotFoundError:
            raw = None
        except orjson.JSONDecodeError:
            raw = {}
        if isinstance(raw, dict) and raw:
            raw.setdefault("conversation_id", conversation_id)
            return raw
        index = self.layout.index_file(conversation_id)
        if raw is None and not index.exists():
            return None
        entries = read_index(index)
        return {"conversation_id": conversation_id, "exchanges": len(entries),
                "last_activity": entries[-1].ts if entries else None,
                "models": list(dict.fromkeys(e.model for e in entries if e.model))}

    def entries(self, conversation_id: str) -> list[IndexEntry]:
        if not is_safe_id(conversation_id):
            return []
        return read_index(self.layout.index_file(conversation_id))

    def response(self, response_id: str) -> ResponseRecord | None:
        if not is_safe_id(response_id):
            return None
        return read_response(self.layout.response_file(response_id))

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


class JsonlReader:
    """The read port over a var dir's files (the default backend)."""

    def __init__(self, layout: VarLayout, database_url: str | None = None) -> None:
        self.files = JsonlFiles(layout)

    async def conversation_ids(self) -> list[str]:
        return await asyncio.to_thread(self.files.conversation_ids)

    async def metas(self, conversation_ids: list[str]) -> list[dict[str, Any] | None]:
        return await asyncio.to_thread(lambda: [self.files.meta(c) for c in conversation_ids])

    async def entries(self, conversation_id: str) -> list[IndexEntry]:
        return await asyncio.to_thread(self.files.entries, conversation_id)

    async def responses(self, response_ids: list[str]) -> list[ResponseRecord | None]:
        return await asyncio.to_thread(lambda: [self.files.response(r) for r in response_ids])

    async def forks_of(self, conversation_id: str) -> list[str]:
        return await asyncio.to_thread(self.files.forks_of, conversation_id)

    async def aclose(self) -> None:
        return None


# name -> "module:class" of its reader, built as `cls(layout, database_url)`; imported only when
# chosen (a database driver is not client-light)
READERS = {
    "jsonl": "ksi_common.reading:JsonlReader",
    "postgres": "ksi_common.postgres_reader:PostgresReader",
}


def open_reader(storage: str, layout: VarLayout, database_url: str | None = None) -> StoredReader:
    """The reader of backend `storage` (`KSI_STORAGE`), for a var dir or a database."""
    try:
        target = READERS[storage]
    except KeyError:
        raise ValueError(f"unknown storage {storage!r}; one of {', '.join(READERS)}") from None
    module_name, class_name = target.split(":")
    reader_class = getattr(importlib.import_module(module_name), class_name)
    return reader_class(layout, database_url)  # type: ignore[no-any-return]
