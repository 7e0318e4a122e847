"""Conversation index files (append-only) and their metadata (small replaceable JSON)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from ksi_common.layout import VarLayout
from ksi_common.records import IndexEntry, read_index, read_index_tail
from ksi_common.timefmt import utc_now
from ksi_daemon.storage.files import append_lines, jsonl, read_json, replace_json


class SystemChange(BaseModel):
    from_n: int
    system: str | None
    ts: str


class CliSession(BaseModel):
    """The CLI session that holds this conversation up to exchange `n`."""

    model: str
    session_id: str
    n: int


class ConversationMeta(BaseModel):
    v: int = 1
    conversation_id: str
    created: str = Field(default_factory=utc_now)
    last_activity: str = Field(default_factory=utc_now)
    title: str | None = None
    tags: list[str] = Field(default_factory=list)
    status: Literal["active", "archived"] = "active"
    agent_id: str | None = None
    system: str | None = None
    system_changes: list[SystemChange] = Field(default_factory=list)
    parent_id: str | None = None
    fork_at: int | None = None
    ttl: float | None = None
    turn_cap: int | None = None
    cli_session: CliSession | None = None
    exchanges: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    cost: float = 0.0
    models: list[str] = Field(default_factory=list)
    extra: dict[str, Any] = Field(default_factory=dict)


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
