"""Request bodies of the Messages door, validated at the boundary (errors name the field). Content
blocks stay plain dicts here: translate.py reads each by its `type`, so an unknown or refused
block is named with its place (`messages.3.content.1.type`) rather than as a union's mismatch."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from ksi_common.limits import MAX_TOKENS
from ksi_daemon.transports.http.openai.schemas import Body

Block = dict[str, Any]


class MessageParam(Body):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Metadata(Body):
    user_id: str | None = Field(default=None, max_length=256)


class MessagesCreate(Body):
    """`POST /v1/messages`: fields it does not declare are kept (model_extra) and go to the provider."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, max_length=256)
    max_tokens: int = Field(gt=0, le=MAX_TOKENS)
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[Block] | None = None
    metadata: Metadata | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = Field(default=None, gt=0)
    tools: list[Block] | None = None
    tool_choice: Block | None = None
    thinking: Block | None = None


class CountTokens(Body):
    """`POST /v1/messages/count_tokens`: what a Messages request would send, without max_tokens."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, max_length=256)
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[Block] | None = None
