"""Payloads of the `completion:*` events."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from ksi_common.limits import MAX_TIMEOUT, MAX_TOKENS
from ksi_daemon.events import Door, EventData, ModelName, NonBlank, PathText, SafeId, Text
from ksi_daemon.providers.options import check_request_options


class InputMessage(EventData):
    role: Literal["user", "system"] = Field(description="user or system; earlier turns go in history")
    content: Text = Field(min_length=1)


class CompletionAsync(EventData):
    prompt: NonBlank | None = Field(default=None, description="the new user input (or use messages)")
    messages: list[InputMessage] | None = Field(default=None, description="new input messages, user or system roles")
    model: ModelName | None = Field(default=None, description="model name; defaults to the agent's, the conversation's last, then the setting")
    conversation_id: SafeId | None = Field(default=None, description="continue this conversation; absent starts a new one")
    previous_response_id: SafeId | None = Field(
        default=None, description="continue after this response: its conversation, or a fork at it when it is not the newest exchange")
    agent_id: SafeId | None = Field(default=None, description="the agent asking; its profile supplies system prompt and model")
    history: list[dict[str, Any]] | None = Field(
        default=None, max_length=100_000,
        description="the client's own earlier turns as items (messages of role user, assistant or system; "
                    "function_call, function_call_output): matched to the stored conversation they belong to")
    create: bool = Field(default=False, description="create conversation_id when it does not exist yet")
    system: Text | None = Field(default=None, description="system prompt; replaces the conversation's from now on")
    instructions: Text | None = Field(default=None, description="system prompt for this request only; the conversation's is kept")
    temperature: float | None = Field(default=None, ge=0, le=2, description="sampling temperature")
    max_tokens: int | None = Field(default=None, gt=0, le=MAX_TOKENS, description="upper bound on the answer's tokens")
    timeout: float | None = Field(default=None, gt=0, le=MAX_TIMEOUT, description="seconds allowed per provider attempt")
    stream: bool = Field(default=False, description="push completion:chunk events while the answer arrives")
    background: bool = Field(
        default=False, description="keep the answer's chunks for completion:chunks while it runs and for some "
                                   "minutes after, so it can be read (again) by response id whoever is connected")
    files: list[PathText] = Field(default_factory=list, description="paths to attach (within allowed roots)")
    is_feedback: bool = Field(default=False, description="logged and indexed, but kept out of later history")
    metadata: dict[str, Any] = Field(default_factory=dict, description="free-form, stored with the request")
    extra_body: dict[str, Any] | None = Field(default=None, description="passed to the provider as extra_body")
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="provider options: the sampling/format ones (seed, stop, top_p, presence_penalty, "
                    "frequency_penalty, max_tokens, reasoning_effort, response_format, logit_bias, user) are "
                    "checked in shape; tools, tool_choice, functions, n > 1, logprobs and stream are refused "
                    "(unsupported_parameter); others go to the provider by name")
    consortium: dict[str, Any] | None = Field(default=None, description="an inline consortium definition")
    external_ids: dict[SafeId, SafeId] = Field(
        default_factory=dict,
        description="this conversation's ids in other tools, e.g. {\"llm\": ID}; recorded in its metadata when this request creates it")

    origin: Door | None = Field(
        default=None, description="the door the request came through (cli, http, mcp, llm, agent, console); "
                                  "recorded on the conversation it creates")

    @field_validator("options")
    @classmethod
    def _no_bookkeeping(cls, value: dict[str, Any]) -> dict[str, Any]:
        reserved = {"model", "messages", "metadata", "api_key", "api_base"} & set(value)
        if reserved:
            raise ValueError(f"options may not set {sorted(reserved)}")
        # refused options (tools, n > 1, stream, ...) fail with unsupported_parameter, before anything is written
        return check_request_options(value)

    @field_validator("previous_response_id")
    @classmethod
    def _not_with_conversation(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("conversation_id") is not None:
            raise ValueError("give conversation_id or previous_response_id, not both")
        return value

    @model_validator(mode="after")
    def _one_input(self) -> CompletionAsync:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.messages is not None and not any(m.role == "user" for m in self.messages):
            raise ValueError("messages need at least one user message")
        return self

    def input_messages(self) -> list[dict[str, str]]:
        if self.prompt is not None:
            return [{"role": "user", "content": self.prompt}]
        return [{"role": m.role, "content": m.content} for m in self.messages or []]


class RequestRef(EventData):
    request_id: Text = Field(description="the id completion:async returned")


class CompletionWait(RequestRef):
    timeout: float = Field(default=60.0, ge=0, le=MAX_TIMEOUT, description="seconds to wait before replying with the status")


class CompletionStatus(RequestRef):
    pass


class CompletionCancel(RequestRef):
    pass
