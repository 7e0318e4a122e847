"""The ports of the records kept beside conversations: responses, agents, consortia, traces, the
request journal, summaries and token-count calibration."""

from __future__ import annotations

from typing import Any, Protocol

from ksi_common.records import ResponseRecord
from ksi_common.summaries import Summary
from ksi_daemon.storage.models import AgentRecord


class AgentExists(Exception):
    """An exclusive create found the agent record already there."""

    def __init__(self, agent_id: str) -> None:
        super().__init__(f"agent {agent_id} already exists")
        self.agent_id = agent_id


class ResponseStore(Protocol):
    """Response records: one per request, the raw inputs then the outcome, written whole once."""

    async def write(self, response_id: str, lines: list[dict[str, Any]]) -> None:
        """Write a new record, durable before it returns; never overwrites an existing one."""
        ...

    async def read(self, response_id: str) -> ResponseRecord | None: ...

    async def read_many(self, response_ids: list[str]) -> list[ResponseRecord | None]:
        """Records in the order asked, None for a missing one; one round trip where it can."""
        ...

    async def ids(self) -> list[str]:
        """Every stored response id, sorted (indexed or not: failed requests, consortium calls)."""
        ...


class AgentStore(Protocol):
    async def create(self, record: AgentRecord) -> None:
        """Exclusive create: raises `AgentExists` when a record with this id exists."""
        ...

    async def save(self, record: AgentRecord) -> None:
        """Replace the record of an existing agent."""
        ...

    async def load(self, agent_id: str) -> AgentRecord | None: ...

    async def load_all(self) -> list[AgentRecord]:
        """Every readable record; a damaged one is logged and skipped, never fatal."""
        ...


class ConsortiumStore(Protocol):
    """Saved consortium definitions, by name (names are validated by the caller)."""

    async def save(self, name: str, definition: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """Write or replace a definition; returns the stored record and whether one was replaced."""
        ...

    async def load(self, name: str) -> dict[str, Any] | None: ...

    async def load_all(self) -> dict[str, dict[str, Any]]: ...

    async def remove(self, name: str) -> bool: ...


class TraceStore(Protocol):
    """Consortium run traces: one append-only sequence of lines per run."""

    async def append(self, run_id: str, line: dict[str, Any], durable: bool = False) -> None: ...

    async def read(self, run_id: str) -> list[dict[str, Any]] | None:
        """The run's lines in order; None for an unknown run."""
        ...

    async def run_ids(self) -> list[str]:
        """Every run with a trace, sorted."""
        ...


class RequestJournal(Protocol):
    """Request states, so work interrupted by a crash is reported after a restart.

    `record` is called on the hot path and must not block the loop: an implementation may
    buffer and write in the background (lines of one request stay in order). Each daemon has
    its own journal: a shared backend keys it by the daemon's identity.
    """

    def record(self, request_id: str, conversation_id: str, status: str, response_id: str | None = None,
               code: str | None = None, model: str | None = None) -> None:
        """A state of a request; its `queued` line names its model, what a response interrupted by a
        crash is shown with after the restart."""
        ...

    async def states(self) -> list[dict[str, Any]]:
        """The last state of every request the journal holds, in journal order (the lines of a
        request merged, later fields winning): finished ones and the ones left queued or running."""
        ...

    async def replace(self, lines: list[dict[str, Any]]) -> None:
        """Compact the journal to exactly `lines` (the requests kept after a recovery)."""
        ...

    async def close(self) -> None: ...


class SummaryStore(Protocol):
    """Compaction summaries: per conversation, appended in order (each covers exchanges 1..upto)."""

    async def append(self, summary: Summary) -> None: ...

    async def read(self, conversation_id: str) -> list[Summary]:
        """The conversation's summaries, oldest first; a damaged one is skipped."""
        ...


class CalibrationStore(Protocol):
    """Learned token-count ratios per model, kept across restarts (replaced whole)."""

    async def load(self) -> dict[str, dict[str, Any]]:
        """{model: {ratio, samples, tightened}}; empty when none or unreadable."""
        ...

    async def save(self, ratios: dict[str, dict[str, Any]]) -> None: ...
