"""Agent records (one small replaceable JSON file per agent under `var/state/agents/`), and moving
an agent's conversation aside when the agent is reset."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import structlog
from pydantic import ValidationError

from ksi_common.ids import is_safe_id
from ksi_common.layout import VarLayout
from ksi_daemon.storage.models import AgentRecord
from ksi_daemon.storage.conversations import ConversationMeta, ConversationStore
from ksi_daemon.storage.files import read_json, replace_json

log = structlog.get_logger("ksi.storage.agents")


class AgentStore:
    """Blocking file operations on agent records; callers run them off the event loop."""

    def __init__(self, layout: VarLayout, fsync: bool) -> None:
        self.layout = layout
        self.fsync = fsync

    def path(self, agent_id: str) -> Path:
        return self.layout.agents_dir / f"{agent_id}.json"

    def save(self, record: AgentRecord) -> None:
        self.layout.agents_dir.mkdir(parents=True, exist_ok=True)
        replace_json(self.path(record.agent_id), record.model_dump(mode="json"), self.fsync)

    def load_all(self) -> list[AgentRecord]:
        """Every readable record; a damaged file is logged and skipped, never fatal."""
        records = []
        for path in sorted(self.layout.agents_dir.glob("*.json")):
            if not is_safe_id(path.stem):
                continue
            try:
                raw = read_json(path)
                record = AgentRecord.model_validate(raw)
            except (ValueError, ValidationError) as exc:
                log.warning("agent_record_unreadable", path=str(path), error=str(exc)[:200])
                continue
            if record.agent_id != path.stem:
                log.warning("agent_record_misnamed", path=str(path), agent_id=record.agent_id)
                continue
            records.append(record)
        return records


def archive_conversation(store: ConversationStore, conversation_id: str, new_id: str, **extra: Any) -> None:
    """Move a conversation to `new_id`: the index file is renamed (its content untouched) and the
    metadata moves with its `conversation_id` updated; `extra` is noted in the metadata."""
    layout = store.layout
    meta = store.load_meta(conversation_id) or ConversationMeta(conversation_id=conversation_id)
    meta.conversation_id = new_id
    meta.extra.update(extra)
    store.save_meta(meta)  # first: a crash after it leaves the old conversation whole, plus a stray copy
    index = layout.index_file(conversation_id)
    if index.exists():
        os.rename(index, layout.index_file(new_id))
    try:
        layout.meta_file(conversation_id).unlink()
    except FileNotFoundError:
        pass


def repoint_forks(store: ConversationStore, parent_id: str, new_parent_id: str) -> list[str]:
    """Forks of a moved conversation follow it to its new id; returns the forks changed."""
    changed = []
    for path in sorted(store.layout.conversation_meta_dir.glob("*.json")):
        try:
            raw = read_json(path)
        except ValueError:
            continue
        if not isinstance(raw, dict) or raw.get("parent_id") != parent_id:
            continue
        meta = ConversationMeta.model_validate(raw)
        meta.parent_id = new_parent_id
        store.save_meta(meta)
        changed.append(meta.conversation_id)
    return changed
