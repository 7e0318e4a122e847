"""Agent records: one small replaceable JSON file per agent under `state/agents/`; the
`AgentStore` port."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import structlog
from pydantic import ValidationError

from ksi_common.ids import is_safe_id
from ksi_common.layout import VarLayout
from ksi_daemon.storage.jsonl.files import publish_new, read_json, replace_json
from ksi_daemon.storage.models import AgentRecord
from ksi_daemon.storage.ports import AgentExists

log = structlog.get_logger("ksi.storage.agents")


class JsonlAgents:
    def __init__(self, layout: VarLayout, fsync: bool) -> None:
        self.layout = layout
        self.fsync = fsync

    def _path(self, agent_id: str) -> Path:
        return self.layout.agents_dir / f"{agent_id}.json"

    def _create(self, record: AgentRecord) -> None:
        self.layout.agents_dir.mkdir(parents=True, exist_ok=True)
        payload = orjson.dumps(record.model_dump(mode="json"), option=orjson.OPT_INDENT_2)
        try:
            publish_new(self._path(record.agent_id), payload, self.fsync)  # complete when visible
        except FileExistsError:
            raise AgentExists(record.agent_id) from None

    async def create(self, record: AgentRecord) -> None:
        await asyncio.to_thread(self._create, record)

    def _save(self, record: AgentRecord) -> None:
        self.layout.agents_dir.mkdir(parents=True, exist_ok=True)
        replace_json(self._path(record.agent_id), record.model_dump(mode="json"), self.fsync)

    async def save(self, record: AgentRecord) -> None:
        await asyncio.to_thread(self._save, record)

    def _load(self, agent_id: str) -> AgentRecord | None:
        if not is_safe_id(agent_id):
            return None
        path = self._path(agent_id)
        try:
            raw = read_json(path)
            if raw is None:
                return None
            record = AgentRecord.model_validate(raw)
        except (ValueError, ValidationError) as exc:
            log.warning("agent_record_unreadable", path=str(path), error=str(exc)[:200])
            return None
        if record.agent_id != agent_id:
            log.warning("agent_record_misnamed", path=str(path), agent_id=record.agent_id)
            return None
        return record

    async def load(self, agent_id: str) -> AgentRecord | None:
        return await asyncio.to_thread(self._load, agent_id)

    def _load_all(self) -> list[AgentRecord]:
        records = []
        for path in sorted(self.layout.agents_dir.glob("*.json")):
            if is_safe_id(path.stem):
                record = self._load(path.stem)
                if record is not None:
                    records.append(record)
        return records

    async def load_all(self) -> list[AgentRecord]:
        """Every readable record; a damaged file is logged and skipped, never fatal."""
        return await asyncio.to_thread(self._load_all)
