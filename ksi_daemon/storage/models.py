"""Domain records that storage keeps and every backend stores alike."""

from __future__ import annotations

from operator import attrgetter
from typing import Any, Literal

from pydantic import BaseModel, Field

from ksi_common.tallies import TALLIES
from ksi_common.timefmt import utc_now


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
    origin: str | None = None  # the door that created it (cli, http, mcp, llm, agent, console); None: unknown
    preview: str | None = None  # the start of its first input, for lists of untitled conversations
    ttl: float | None = None
    turn_cap: int | None = None
    cli_session: CliSession | None = None
    exchanges: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    cost: float = 0.0
    models: list[str] = Field(default_factory=list)
    pins: list[int] = Field(default_factory=list)  # exchanges kept verbatim in every turn's history
    extra: dict[str, Any] = Field(default_factory=dict)

    def same_but_tallies(self, other: ConversationMeta) -> bool:
        """Whether `other` differs from this only in the running totals an exchange moves, which
        its index and response records also hold (see ksi_common.tallies)."""
        return _not_tallies(self) == _not_tallies(other)


PREVIEW_CHARS = 120


def preview_of(text: str) -> str:
    """The start of an input on one line, bounded: what a list shows for an untitled conversation."""
    line = " ".join(text.split())
    return line if len(line) <= PREVIEW_CHARS else line[:PREVIEW_CHARS - 1].rstrip() + "…"


_not_tallies = attrgetter(*(name for name in ConversationMeta.model_fields if name not in TALLIES))


class AgentRecord(BaseModel):
    """What an agent is: a snapshot of its profile taken at spawn, its state and its conversations."""

    v: int = 1
    agent_id: str
    conversation_id: str
    profile: str | None = None
    model: str | None = None  # None: the daemon's default model at the time of each request
    system: str | None = None
    temperature: float | None = None
    allowed_events: list[str] = Field(default_factory=list)
    options: dict[str, Any] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)
    status: Literal["active", "terminated"] = "active"
    created: str = Field(default_factory=utc_now)
    last_activity: str = Field(default_factory=utc_now)
    terminated_at: str | None = None
    spawned_by: str | None = None
    previous_conversations: list[str] = Field(default_factory=list)  # kept by agent:reset, oldest first
