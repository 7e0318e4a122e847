"""Response records, agent records, consortium definitions and run traces in PostgreSQL: the
`ResponseStore`, `AgentStore`, `ConsortiumStore` and `TraceStore` ports."""

from __future__ import annotations

from typing import Any

import structlog
from pydantic import ValidationError

from ksi_common.postgres_reader import response_of
from ksi_common.records import ResponseRecord
from ksi_common.summaries import Summary
from ksi_common.timefmt import utc_now
from ksi_daemon.storage.models import AgentRecord
from ksi_daemon.storage.ports import AgentExists
from ksi_daemon.storage.postgres.database import Database

log = structlog.get_logger("ksi.storage.postgres")


class PostgresResponses:
    def __init__(self, database: Database) -> None:
        self.database = database

    async def write(self, response_id: str, lines: list[dict[str, Any]]) -> None:
        conversation_id = next((line.get("conversation_id") for line in lines if line.get("conversation_id")), None)
        # never overwrites: a retry of a write that did commit finds its record there and keeps it
        await self.database.run(lambda c: c.execute(
            "INSERT INTO ksi_responses (response_id, conversation_id, lines) VALUES ($1, $2, $3::json) "
            "ON CONFLICT (response_id) DO NOTHING", response_id, conversation_id, lines))

    async def read(self, response_id: str) -> ResponseRecord | None:
        row = await self.database.run(lambda c: c.fetchrow(
            "SELECT lines FROM ksi_responses WHERE response_id = $1", response_id))
        return response_of(response_id, row["lines"]) if row is not None else None

    async def read_many(self, response_ids: list[str]) -> list[ResponseRecord | None]:
        if not response_ids:
            return []
        rows = await self.database.run(lambda c: c.fetch(
            "SELECT response_id, lines FROM ksi_responses WHERE response_id = ANY($1::text[])", response_ids))
        found = {r["response_id"]: response_of(r["response_id"], r["lines"]) for r in rows}
        return [found.get(r) for r in response_ids]

    async def ids(self) -> list[str]:
        rows = await self.database.run(lambda c: c.fetch("SELECT response_id FROM ksi_responses ORDER BY 1"))
        return [r[0] for r in rows]


def agent_of(agent_id: str, raw: Any) -> AgentRecord | None:
    try:
        record = AgentRecord.model_validate(raw)
    except ValidationError as exc:
        log.warning("agent_record_unreadable", agent_id=agent_id, error=str(exc)[:200])
        return None
    return record if record.agent_id == agent_id else None


class PostgresAgents:
    def __init__(self, database: Database) -> None:
        self.database = database

    async def create(self, record: AgentRecord) -> None:
        created = await self.database.run(lambda c: c.fetchval(
            "INSERT INTO ksi_agents (agent_id, record) VALUES ($1, $2::json) ON CONFLICT (agent_id) DO NOTHING "
            "RETURNING 1", record.agent_id, record.model_dump(mode="json")), retry=False)
        if created is None:
            raise AgentExists(record.agent_id)

    async def save(self, record: AgentRecord) -> None:
        await self.database.run(lambda c: c.execute(
            "INSERT INTO ksi_agents (agent_id, record) VALUES ($1, $2::json) ON CONFLICT (agent_id) "
            "DO UPDATE SET record = EXCLUDED.record, version = ksi_agents.version + 1",
            record.agent_id, record.model_dump(mode="json")))

    async def load(self, agent_id: str) -> AgentRecord | None:
        raw = await self.database.run(lambda c: c.fetchval(
            "SELECT record FROM ksi_agents WHERE agent_id = $1", agent_id))
        return agent_of(agent_id, raw) if raw is not None else None

    async def load_all(self) -> list[AgentRecord]:
        rows = await self.database.run(lambda c: c.fetch("SELECT agent_id, record FROM ksi_agents ORDER BY agent_id"))
        return [record for row in rows if (record := agent_of(row["agent_id"], row["record"])) is not None]


def with_created(row: Any) -> dict[str, Any] | None:
    record = row["record"]
    return {**record, "created": row["created"]} if isinstance(record, dict) else None


class PostgresConsortia:
    def __init__(self, database: Database) -> None:
        self.database = database

    async def save(self, name: str, definition: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        now = utc_now()
        record = {"v": 1, "name": name, **definition, "created": now, "updated": now}
        # one statement: two daemons saving at once agree on `created` (the first save's)
        row = await self.database.run(lambda c: c.fetchrow(
            """
            INSERT INTO ksi_consortia (name, record, created) VALUES ($1, $2::json, $3)
            ON CONFLICT (name) DO UPDATE SET record = EXCLUDED.record
            RETURNING created, xmax <> 0 AS replaced
            """, name, record, now))
        record["created"] = row["created"]
        return record, bool(row["replaced"])

    async def load(self, name: str) -> dict[str, Any] | None:
        row = await self.database.run(lambda c: c.fetchrow(
            "SELECT record, created FROM ksi_consortia WHERE name = $1", name))
        return with_created(row) if row is not None else None

    async def load_all(self) -> dict[str, dict[str, Any]]:
        rows = await self.database.run(lambda c: c.fetch("SELECT name, record, created FROM ksi_consortia ORDER BY name"))
        return {r["name"]: found for r in rows if (found := with_created(r)) is not None}

    async def remove(self, name: str) -> bool:
        removed = await self.database.run(lambda c: c.fetchval(
            "DELETE FROM ksi_consortia WHERE name = $1 RETURNING 1", name))
        return removed is not None


class PostgresTraces:
    def __init__(self, database: Database) -> None:
        self.database = database

    async def append(self, run_id: str, line: dict[str, Any], durable: bool = False) -> None:
        # every commit is durable here; `durable` matters to files, whose fsync is optional
        await self.database.run(lambda c: c.execute(
            "INSERT INTO ksi_consortium_traces (run_id, record) VALUES ($1, $2::json)", run_id, line), retry=False)

    async def read(self, run_id: str) -> list[dict[str, Any]] | None:
        rows = await self.database.run(lambda c: c.fetch(
            "SELECT record FROM ksi_consortium_traces WHERE run_id = $1 ORDER BY seq", run_id))
        return [r["record"] for r in rows] if rows else None

    async def run_ids(self) -> list[str]:
        rows = await self.database.run(lambda c: c.fetch("SELECT DISTINCT run_id FROM ksi_consortium_traces ORDER BY 1"))
        return [r[0] for r in rows]


class PostgresSummaries:
    """Compaction summaries, appended per conversation in order."""

    def __init__(self, database: Database) -> None:
        self.database = database

    async def append(self, summary: Summary) -> None:
        await self.database.run(lambda c: c.execute(
            "INSERT INTO ksi_summaries (conversation_id, upto, record) VALUES ($1, $2, $3::json)",
            summary.conversation_id, summary.upto, summary.to_record()), retry=False)

    async def read(self, conversation_id: str) -> list[Summary]:
        rows = await self.database.run(lambda c: c.fetch(
            "SELECT record FROM ksi_summaries WHERE conversation_id = $1 ORDER BY seq", conversation_id))
        return [s for r in rows if (s := Summary.from_record(r["record"])) is not None]


class PostgresCalibration:
    """Learned token-count ratios per model: one document, replaced whole."""

    def __init__(self, database: Database) -> None:
        self.database = database

    async def load(self) -> dict[str, dict[str, Any]]:
        ratios = await self.database.run(lambda c: c.fetchval("SELECT ratios FROM ksi_calibration"))
        if ratios is not None and not isinstance(ratios, dict):  # damaged: every model from 1.0
            log.warning("calibration_document_unreadable", found=type(ratios).__name__)
        return ratios if isinstance(ratios, dict) else {}

    async def save(self, ratios: dict[str, dict[str, Any]]) -> None:
        await self.database.run(lambda c: c.execute(
            "INSERT INTO ksi_calibration (ratios) VALUES ($1::json) ON CONFLICT (id) DO UPDATE SET ratios = EXCLUDED.ratios",
            ratios))
