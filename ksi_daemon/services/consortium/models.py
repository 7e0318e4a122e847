"""Consortium definitions and the payloads of the `consortium:*` events."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from ksi_common.errors import ErrorCode, KsiError
from ksi_daemon.events import EventData, SafeId, Text, check_model_name, validate

CONSORTIUM_PREFIX = "consortium/"
INLINE_NAME = "inline"  # `consortium: {...}` on a request makes its model `consortium/inline`
MAX_INSTANCES = 16  # per member entry
MAX_TOTAL_INSTANCES = 32  # per consortium: every instance is one model call per iteration
MAX_ITERATIONS = 10

# A model name as litellm takes it: provider/name, with `:` tags (ollama/qwen3:4b) and dots.
_MODEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/@+-]*")
_COUNT = re.compile(r"[+-]?\d+")


def _check_model(value: str, what: str) -> str:
    if not value:
        raise ValueError(f"{what} must name a model")
    check_model_name(value)
    if not _MODEL.fullmatch(value) or value.endswith((":", "/")):
        raise ValueError(f"{what} {value!r} is not a model name such as provider/model or ollama/qwen3:4b")
    if value.startswith(CONSORTIUM_PREFIX):
        raise ValueError(f"{what} may not be a consortium (consortia do not nest)")
    return value


class Member(BaseModel):
    """One member model and how many instances of it answer each iteration."""

    model_config = ConfigDict(extra="forbid")

    model: str
    count: int = Field(default=1, ge=1, le=MAX_INSTANCES)

    @model_validator(mode="before")
    @classmethod
    def _from_text(cls, value: Any) -> Any:
        # "openai/gpt-4o:2" is two instances; a count only when the text after the LAST colon is
        # an integer, so "ollama/qwen3:4b" is one instance of that model.
        if not isinstance(value, str):
            return value
        text = value.strip()
        head, colon, tail = text.rpartition(":")
        if colon and _COUNT.fullmatch(tail):
            count = int(tail)
            if count < 1:
                raise ValueError(f"{text!r}: an instance count must be at least 1 (for a model whose name "
                                 "ends in ':N' write {\"model\": ..., \"count\": 1})")
            return {"model": head, "count": count}
        return {"model": text, "count": 1}

    @field_validator("model")
    @classmethod
    def _model(cls, value: str) -> str:
        return _check_model(value.strip(), "member model")

    def to_record(self) -> dict[str, Any]:
        return {"model": self.model, "count": self.count}


def _threshold(value: Any) -> Any:
    # 80 reads as 80 %; a value above 100 is neither a fraction nor a percentage
    if isinstance(value, bool):
        raise ValueError("must be a number")
    if isinstance(value, str):
        try:
            value = float(value.strip().rstrip("%"))
        except ValueError:
            raise ValueError("must be a number") from None
    if isinstance(value, int | float):
        if value > 100:
            raise ValueError("must be a fraction (0.8) or a percentage (80), at most 100")
        if value > 1:
            return value / 100
    return value


class ConsortiumDefinition(EventData):
    """What a consortium is: members, arbiter, how it judges and when it stops iterating."""

    members: list[Member] = Field(min_length=1, description='member models, e.g. ["openai/gpt-4o:2", '
                                  '"ollama/qwen3:4b"] or [{"model": ..., "count": ...}]')
    arbiter: Text = Field(description="the model that judges the member answers")
    confidence_threshold: float = Field(default=0.8, ge=0, le=1,
                                        description="stop once the arbiter is this confident (0.8 or 80)")
    min_iterations: int = Field(default=1, ge=1, le=MAX_ITERATIONS, description="iterate at least this often")
    max_iterations: int = Field(default=3, ge=1, le=MAX_ITERATIONS, description="iterate at most this often")
    judging: Literal["synthesis", "rank"] = Field(
        default="synthesis", description="synthesis: the arbiter writes the answer; rank: it picks the best "
        "member answer, returned verbatim")
    system: Text | None = Field(default=None, description="system prompt added for members (after the "
                                "conversation's own)")
    timeout: float | None = Field(default=None, gt=0, le=3600, description="seconds each member may take, "
                                  "retries included (default: the request's timeout)")

    @field_validator("members")
    @classmethod
    def _members(cls, value: list[Member]) -> list[Member]:
        total = sum(m.count for m in value)
        if total > MAX_TOTAL_INSTANCES:
            raise ValueError(f"{total} member instances; at most {MAX_TOTAL_INSTANCES}")
        return value

    @field_validator("arbiter")
    @classmethod
    def _arbiter(cls, value: str) -> str:
        return _check_model(value.strip(), "arbiter")

    @field_validator("confidence_threshold", mode="before")
    @classmethod
    def _confidence(cls, value: Any) -> Any:
        return _threshold(value)

    @field_validator("max_iterations")
    @classmethod
    def _iterations(cls, value: int, info: ValidationInfo) -> int:
        least = info.data.get("min_iterations")
        if least is not None and value < least:
            raise ValueError(f"must be at least min_iterations ({least})")
        return value

    def instances(self) -> list[tuple[str, int]]:
        """Every member instance as (model, instance number from 1), in definition order."""
        return [(m.model, k) for m in self.members for k in range(1, m.count + 1)]

    def to_record(self) -> dict[str, Any]:
        record = self.model_dump(mode="json", include=set(ConsortiumDefinition.model_fields))
        record["members"] = [m.to_record() for m in self.members]
        return record


def parse_definition(raw: Any, field: str = "consortium") -> ConsortiumDefinition:
    """An inline definition, with `validation_error` fields named under `field`."""
    try:
        return validate(ConsortiumDefinition, raw)  # type: ignore[return-value]
    except KsiError as error:
        fields = {f"{field}.{name}": message for name, message in error.details.get("fields", {}).items()}
        raise KsiError(ErrorCode.VALIDATION_ERROR,
                       "invalid consortium: " + "; ".join(f"{k}: {v}" for k, v in fields.items()),
                       fields=fields) from None


class ConsortiumSave(ConsortiumDefinition):
    name: SafeId = Field(description="the consortium's name; use it as model consortium/NAME")

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if value == INLINE_NAME:
            raise ValueError(f"{INLINE_NAME!r} is reserved for inline definitions")
        return value


class ConsortiumRef(EventData):
    name: SafeId = Field(description="a saved consortium's name")


class ConsortiumRuns(EventData):
    limit: int = Field(default=50, gt=0, le=1000, description="page size")
    offset: int = Field(default=0, ge=0, description="how many runs to skip")


class ConsortiumTrace(EventData):
    run_id: SafeId = Field(description="the run_id a consortium completion's result carries")
