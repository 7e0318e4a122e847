"""The agents a daemon knows, and the completion service's agent directory.

Built before both services, so the completion service reads agents' defaults and the agent
service submits completions without either holding the other (no attribute set after
construction). Records are kept in memory; an id not in memory is looked up in the agent store,
so an agent spawned by another daemon on a shared backend can be messaged here.
"""

from __future__ import annotations

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.settings import Settings
from ksi_daemon.services.completion.admission import AgentDefaults
from ksi_daemon.storage.models import AgentRecord
from ksi_daemon.storage.ports import AgentStore


class AgentRegistry:
    def __init__(self, settings: Settings, store: AgentStore) -> None:
        self.settings = settings
        self.store = store
        self.records: dict[str, AgentRecord] = {}

    async def load(self) -> None:
        for record in await self.store.load_all():
            self.records[record.agent_id] = record

    async def get(self, agent_id: str) -> AgentRecord:
        record = self.records.get(agent_id)
        if record is None:
            record = await self.store.load(agent_id)
            if record is None:
                raise KsiError(ErrorCode.AGENT_NOT_FOUND, f"no agent {agent_id}", agent_id=agent_id)
            record = self.records.setdefault(agent_id, record)
        return record

    async def active(self, agent_id: str) -> AgentRecord:
        record = await self.get(agent_id)
        if record.status == "terminated":
            raise KsiError(ErrorCode.AGENT_TERMINATED, f"agent {agent_id} was terminated", agent_id=agent_id,
                           terminated_at=record.terminated_at)
        return record

    def model(self, record: AgentRecord) -> str:
        return record.model or self.settings.default_model

    async def defaults(self, agent_id: str) -> AgentDefaults:
        record = await self.active(agent_id)
        return AgentDefaults(
            conversation_id=record.conversation_id, system=record.system, model=self.model(record),
            temperature=record.temperature, options=dict(record.options),
        )
