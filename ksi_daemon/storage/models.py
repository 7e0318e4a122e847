"""Domain records that storage keeps and every backend stores alike."""

from __future__ import annotations

from functools import cache
from operator import attrgetter
from typing import Any, Literal

from pydantic import (
    BaseModel,
    Field,
    SerializerFunctionWrapHandler,
    TypeAdapter,
    ValidationError,
    model_serializer,
    model_validator,
)

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


class CompactionTally(BaseModel):
    """What compaction has done to a conversation so far: summaries written, the newest exchange
    they cover, what they cost, and how many were written without a model."""

    summaries: int = 0
    covered: int = 0
    cost: float = 0.0
    fallbacks: int | None = None  # absent until the first fallback, as records have always had it

    def added(self, upto: int, cost: float, fallback: bool) -> CompactionTally:
        """The tally with one more summary, covering exchanges up to `upto`."""
        return CompactionTally(summaries=self.summaries + 1, covered=max(self.covered, upto), cost=self.cost + cost,
                               fallbacks=(self.fallbacks or 0) + 1 if fallback else self.fallbacks)


class PendingInput(BaseModel):
    """Input a client added to a conversation that waits for a reply: a user message's text, or a
    call's output item (`item`, with its text in `content`, so every reader of `content` shows
    something)."""

    id: str
    content: str
    ts: str
    item: dict[str, Any] | None = None

    def wire(self) -> dict[str, Any]:
        """The entry as replies and stored records carry it: no `item` for a message."""
        entry: dict[str, Any] = {"id": self.id, "content": self.content, "ts": self.ts}
        if self.item is not None:
            entry["item"] = self.item
        return entry


# typed fields a stored record keeps under `extra` (its shape from before they were typed, which
# the `ksi` readers, export files and older daemons read): lifted out when read, put back when dumped
IN_EXTRA = ("scope", "fork_digest", "continues", "imported_from", "imported_at", "imported_models",
            "compaction", "external_ids", "pending_input")


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
    scope: dict[str, str] | None = None  # whom it was made for: {"agent_id"?, "user"?, "safety_identifier"?}
    fork_digest: str | None = None  # a fork's: the chained digest of its fork point, exchange fork_at
    continues: dict[str, Any] | None = None  # an import's: {"conversation_id", "exchange"} it carries on
    imported_from: str | None = None  # a copy's: the conversation it was imported from
    imported_at: str | None = None
    imported_models: list[str] | None = None  # the models the imported exchanges name (history, not routes)
    compaction: CompactionTally | None = None
    external_ids: dict[str, str] | None = None  # other tools' ids for it (llm's, say)
    # input a client added that waits for the next exchange, oldest first (None: none waits)
    pending_input: list[PendingInput] | None = None
    extra: dict[str, Any] = Field(default_factory=dict)  # the client's metadata, notes of moves

    @model_validator(mode="before")
    @classmethod
    def _lift_from_extra(cls, data: Any) -> Any:
        """A stored record keeps the typed fields under `extra`: each one of the right shape goes to
        its field (a malformed one stays in `extra`, read as before: ignored)."""
        if not isinstance(data, dict) or not isinstance(data.get("extra"), dict):
            return data
        extra = dict(data["extra"])
        lifted = dict(data)
        for name in IN_EXTRA:
            if name in extra and name not in data:
                try:
                    lifted[name] = _adapter(name).validate_python(extra[name])
                except ValidationError:
                    continue
                del extra[name]
        lifted["extra"] = extra
        return lifted

    @model_serializer(mode="wrap")
    def _keep_in_extra(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        record: dict[str, Any] = handler(self)
        extra = dict(record.get("extra") or {})
        for name in IN_EXTRA:
            value = record.pop(name, None)
            if name == "pending_input":  # a message's entry has no `item`, as always stored; none waits: absent
                value = [{k: v for k, v in entry.items() if k != "item" or v is not None}
                         for entry in value] if value else None
            if value is not None:
                extra[name] = ({k: v for k, v in value.items() if v is not None} if name == "compaction" else value)
        record["extra"] = extra
        return record

    def same_but_tallies(self, other: ConversationMeta) -> bool:
        """Whether `other` differs from this only in the running totals an exchange moves, which
        its index and response records also hold (see ksi_common.tallies)."""
        return _not_tallies(self) == _not_tallies(other)


PREVIEW_CHARS = 120


def preview_of(text: str) -> str:
    """The start of an input on one line, bounded: what a list shows for an untitled conversation."""
    line = " ".join(text.split())
    return line if len(line) <= PREVIEW_CHARS else line[:PREVIEW_CHARS - 1].rstrip() + "…"


@cache
def _adapter(name: str) -> TypeAdapter[Any]:
    return TypeAdapter(ConversationMeta.model_fields[name].annotation)


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
