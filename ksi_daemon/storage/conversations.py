"""Conversation index files (append-only) and their metadata (small replaceable JSON)."""

from __future__ import annotations

from pathlib import Path

from ksi_common.layout import VarLayout
from ksi_common.records import IndexEntry, read_index, read_index_tail
from ksi_daemon.storage.models import CliSession, ConversationMeta, SystemChange  # noqa: F401  (re-exported)
from ksi_daemon.storage.files import append_lines, jsonl, read_json, replace_json


class ConversationStore:
    """Blocking file operations on conversations; callers run them off the event loop."""

    def __init__(self, layout: VarLayout, fsync: bool) -> None:
        self.layout = layout
        self.fsync = fsync

    def index_path(self, conversation_id: str) -> Path:
        return self.layout.index_file(conversation_id)

    def exists(self, conversation_id: str) -> bool:
        return (
            self.layout.meta_file(conversation_id).exists()
            or self.layout.index_file(conversation_id).exists()
        )

    def load_meta(self, conversation_id: str) -> ConversationMeta | None:
        raw = read_json(self.layout.meta_file(conversation_id))
        if raw is None:
            if self.layout.index_file(conversation_id).exists():
                return ConversationMeta(conversation_id=conversation_id)  # an index without metadata
            return None
        return ConversationMeta.model_validate(raw)

    def save_meta(self, meta: ConversationMeta) -> None:
        path = self.layout.meta_file(meta.conversation_id)
        value = meta.model_dump(mode="json")
        try:
            replace_json(path, value)
        except FileNotFoundError:  # the first conversation of a fresh var dir
            path.parent.mkdir(parents=True, exist_ok=True)
            replace_json(path, value)

    def append_exchange(self, conversation_id: str, entry: IndexEntry) -> None:
        append_lines(self.index_path(conversation_id), jsonl([entry.to_record()]), self.fsync)

    def read_index(self, conversation_id: str) -> list[IndexEntry]:
        return read_index(self.index_path(conversation_id))

    def read_tail(self, conversation_id: str, token_budget: int) -> tuple[list[IndexEntry], int]:
        return read_index_tail(self.index_path(conversation_id), token_budget)

    def list_ids(self) -> list[str]:
        ids = {p.stem for p in self.layout.conversations_dir.glob("*.jsonl")}
        ids |= {p.stem for p in self.layout.conversation_meta_dir.glob("*.json")}
        return sorted(ids)
