"""An export document to import, checked whole before anything is written: types, finite
numbers within bounds, parseable times, and file references that will never be read again."""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.limits import MAX_COST, MAX_TIMEOUT, MAX_TOKENS, MAX_TTL, MAX_TURN_CAP
from ksi_common.timefmt import format_ts, parse_ts
from ksi_daemon.events import check_model_name, check_safe_id

MAX_EXCHANGES = 100_000
MAX_DURATION_MS = MAX_TIMEOUT * 1000


def _time(value: str) -> str:
    try:
        format_ts(parse_ts(value))
    except (ValueError, OverflowError, OSError):
        raise ValueError("must be an ISO-8601 time such as 2026-01-02T03:04:05Z") from None
    return value


def _no_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError("must not contain a NUL byte")
    return value


def _usage(value: dict[str, Any]) -> dict[str, Any]:
    for key, number in value.items():
        if number is None or isinstance(number, bool):
            continue
        if not isinstance(number, int) or not 0 <= number <= MAX_TOKENS:
            raise ValueError(f"{key} must be a whole number of tokens from 0 to {MAX_TOKENS}")
    return value


def _finite(value: float | None) -> float | None:
    if value is not None and not math.isfinite(value):
        raise ValueError("must be a finite number")
    return value


Time = Annotated[str, AfterValidator(_time)]
# as the events check them, but strict: a document's number is not taken for a name
AgentId = Annotated[str, AfterValidator(check_safe_id)]
ModelName = Annotated[str, AfterValidator(check_model_name)]
Tokens = Annotated[int, Field(ge=0, le=MAX_TOKENS)]
Usage = Annotated[dict[str, Any], AfterValidator(_usage)]


class _Part(BaseModel):
    # exports carry more than an import uses (inherited marks, numbers, ids): ignored, not refused;
    # strict types: a number where text belongs is a damaged document, not something to coerce
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


class ImportedFile(_Part):
    """A file reference: kept as history, never read from disk (only files attached through this
    daemon are read again)."""

    path: Annotated[str, AfterValidator(_no_nul)]
    size: Annotated[int, Field(ge=0)] | None = None
    sha256: Annotated[str, Field(max_length=128)] | None = None
    missing: bool | None = None


class ImportedInput(_Part):
    """An input line: a message (user, feedback, system) or a function_call_output; its item is
    checked with the others (`imported_items`), so an unknown type is named as such."""

    type: str = "user"
    content: str | None = None
    call_id: str | None = None
    output: str | None = None
    ts: Time | None = None
    agent_id: str | None = None
    from_agent: str | None = None
    files: list[ImportedFile] = Field(default_factory=list)


class ImportedReply(_Part):
    content: str
    model: ModelName | None = None
    provider: str | None = None
    finish_reason: str | None = None
    usage: Usage = Field(default_factory=dict)
    cost: Annotated[float, Field(ge=0, le=MAX_COST), AfterValidator(_finite)] | None = None
    duration_ms: Annotated[float, Field(ge=0, le=MAX_DURATION_MS)] | None = None
    ts: Time | None = None


class ImportedHistoryTokens(_Part):
    """What an exchange costs in a later turn's history (KSI's own count), as an export carries it."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True, populate_by_name=True)

    tokens_in: Tokens = Field(alias="in")
    tokens_out: Tokens = Field(alias="out")


class ImportedExchange(_Part):
    inputs: list[ImportedInput] = Field(default_factory=list)
    # the exchange's items (an export made since items existed has them): checked by `imported_items`
    input: list[Any] | None = None
    output: list[Any] | None = None
    reply: ImportedReply | None = None
    response_id: str | None = None
    ts: Time | None = None
    model: ModelName | None = None
    provider: str | None = None
    agent_id: AgentId | None = None
    # the provider's counts when it reported them (older exports: KSI's history counts)
    tokens_in: Tokens | None = None
    tokens_out: Tokens | None = None
    history_tokens: ImportedHistoryTokens | None = None
    is_feedback: bool = False

    def history_counts(self) -> tuple[int | None, int | None]:
        """What the exchange costs in a later turn's history, when the document says."""
        if self.history_tokens is not None:
            return self.history_tokens.tokens_in, self.history_tokens.tokens_out
        return self.tokens_in, self.tokens_out


class ImportedConversation(_Part):
    conversation_id: str | None = None
    title: str | None = None
    tags: list[str] = Field(default_factory=list)
    agent_id: AgentId | None = None
    system: str | None = None
    created: Time | None = None
    last_activity: Time | None = None
    ttl: Annotated[float, Field(gt=0, le=MAX_TTL)] | None = None
    turn_cap: Annotated[int, Field(gt=0, le=MAX_TURN_CAP)] | None = None
    pins: Annotated[list[Annotated[int, Field(gt=0)]], Field(max_length=MAX_EXCHANGES)] = Field(default_factory=list)


class ImportedDocument(_Part):
    conversation: ImportedConversation
    exchanges: Annotated[list[ImportedExchange], Field(max_length=MAX_EXCHANGES)]


def checked_document(document: dict[str, Any]) -> ImportedDocument:
    """The whole document validated, or `validation_error` naming every bad field (as
    `data.exchanges.3.reply.usage`); nothing is written before this passes."""
    try:
        return ImportedDocument.model_validate(document)
    except ValidationError as exc:
        fields: dict[str, str] = {}
        for error in exc.errors(include_url=False):
            where = ".".join(str(part) for part in error["loc"])
            fields[f"data.{where}" if where else "data"] = error["msg"]
            if len(fields) >= 20:
                break
        raise KsiError(ErrorCode.VALIDATION_ERROR,
                       "the export cannot be imported: " + "; ".join(f"{k}: {v}" for k, v in list(fields.items())[:5]),
                       fields=fields) from None
