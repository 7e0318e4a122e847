"""Payloads of the `completion:*` events."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StringConstraints, ValidationInfo, field_validator, model_validator

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.items import Item, message
from ksi_common.limits import MAX_TIMEOUT, MAX_TOKENS
from ksi_daemon.events import Door, EventData, ModelName, NonBlank, PathText, SafeId, Text
from ksi_daemon.providers.options import REFUSED_OPTIONS, Penalty, ResponseFormat, check_request_options
from ksi_daemon.services.completion.input_items import (
    MAX_TOOLS,
    ClientTool,
    InputItem,
    ToolChoice,
    checked_choice,
    checked_tools,
    client_tools,
    items_of,
    media_parts,
)
from ksi_daemon.services.completion.tool_call_cap import call_limit

# sampling fields a request may give at its top level; they reach the provider as options do
SAMPLING_FIELDS = ("seed", "stop", "top_p", "presence_penalty", "frequency_penalty", "reasoning_effort",
                   "response_format")
# one name of Anthropic's anthropic-beta header ("prompt-caching-2024-07-31"): nothing that could end the header
BetaName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9._-]{1,100}$")]
TOOL_OPTIONS = ("tools", "tool_choice", "parallel_tool_calls", "functions", "function_call")


class InputMessage(EventData):
    role: Literal["user", "system"] = Field(description="user or system; earlier turns go in history")
    content: Text = Field(min_length=1)


class CompletionAsync(EventData):
    prompt: NonBlank | None = Field(default=None, description="the new user input (or use messages)")
    messages: list[InputMessage] | None = Field(default=None, description="new input messages, user or system roles")
    input: list[InputItem] | None = Field(
        default=None, min_length=1,
        description="new input as items: messages (user or system; text or parts) and function_call_output "
                    "items answering the calls of the conversation's newest exchange")
    model: ModelName | None = Field(default=None, description="model name; defaults to the agent's, the conversation's last, then the setting")
    conversation_id: SafeId | None = Field(default=None, description="continue this conversation; absent starts a new one")
    previous_response_id: SafeId | None = Field(
        default=None, description="continue after this response: its conversation, or a fork at it when it is not the newest exchange")
    previous_by_item: bool = Field(
        default=False, description="previous_response_id was read from the id of an item the client sent: it "
                                   "is taken only within the request's scope (else item_not_found)")
    agent_id: SafeId | None = Field(default=None, description="the agent asking; its profile supplies system prompt and model")
    history: list[dict[str, Any]] | None = Field(
        default=None, max_length=100_000,
        description="the client's own earlier turns as items (messages of role user, assistant or system; "
                    "function_call, function_call_output): matched to the stored conversation they belong to")
    appended: list[dict[str, Any]] | None = Field(
        default=None, min_length=1, max_length=100_000,
        description="with previous_response_id or conversation_id: the client's own turns after that point, as "
                    "items (messages, function_call, function_call_output, reasoning, item_reference), before the "
                    "new input; those the conversation already holds there are continued, the others added")
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
    tools: list[ClientTool] = Field(
        default_factory=list, max_length=MAX_TOOLS,
        description='tools the client runs: {"type": "function", "name", "description", "parameters" (a JSON schema '
                    'object), "strict"} (the chat-completions form {"type": "function", "function": {...}} is taken '
                    'too), {"type": "custom", "name", "description", "format"} (free text input), {"type": '
                    '"namespace", "name", "tools": [function or custom tools]}, {"type": "local_shell"}, {"type": "shell"}')
    tool_choice: ToolChoice | None = Field(
        default=None, description='"auto", "none", "required", or {"type": "function" or "custom", "name": NAME}')
    parallel_tool_calls: bool | None = Field(default=None, description="whether the model may call several tools at once")
    anthropic_beta: list[BetaName] = Field(
        default_factory=list, max_length=32,
        description="Anthropic API beta features (its anthropic-beta header), sent to models called through "
                    "Anthropic's API only; other providers have no such header")
    response_format: ResponseFormat | None = Field(
        default=None, description='{"type": "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}')
    seed: int | None = Field(default=None, description="sampling seed, for providers that take one")
    stop: str | Annotated[list[str], Field(min_length=1, max_length=4)] | None = Field(
        default=None, description="up to four stop sequences")
    top_p: float | None = Field(default=None, ge=0, le=1, description="nucleus sampling")
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = Field(
        default=None, description="how much a reasoning model thinks before answering")
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="provider options: the sampling/format ones (seed, stop, top_p, presence_penalty, "
                    "frequency_penalty, max_tokens, reasoning_effort, response_format, logit_bias, user) are "
                    "checked in shape; n > 1, logprobs and stream are refused (unsupported_parameter), tools "
                    "go in the tools field; others go to the provider by name")
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
        tooled = {f"options.{name}": f"give it as the request's {'tools' if 'function' in name else name} field"
                  for name in TOOL_OPTIONS if name in value and not REFUSED_OPTIONS[name][0](value[name])}
        if tooled:
            raise KsiError(ErrorCode.UNSUPPORTED_PARAMETER,
                           "; ".join(f"{name} is not taken in options: {why}" for name, why in tooled.items()),
                           fields=tooled)
        call_limit(value)  # a bad max_tool_calls is refused before anything is written
        # refused options (tools, n > 1, stream, ...) fail with unsupported_parameter, before anything is written
        return check_request_options(value)

    @field_validator("previous_response_id")
    @classmethod
    def _not_with_conversation(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("conversation_id") is not None:
            raise ValueError("give conversation_id or previous_response_id, not both")
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _typed_tools(cls, value: Any) -> Any:
        return client_tools(value)

    @field_validator("tools")
    @classmethod
    def _distinct_tools(cls, value: list[Any]) -> list[Any]:
        return checked_tools(value)

    @model_validator(mode="after")
    def _one_input(self) -> CompletionAsync:
        if sum(given is not None for given in (self.prompt, self.messages, self.input)) != 1:
            raise ValueError("give exactly one of prompt, messages or input")
        if self.messages is not None and not any(m.role == "user" for m in self.messages):
            raise ValueError("messages need at least one user message")
        if self.input is not None:
            items = items_of(self.input)  # refuses the parts it cannot keep (unsupported_parameter)
            if not any(i["type"] == "function_call_output" or i["role"] == "user" for i in items):
                raise ValueError("input needs a user message or a function_call_output")
            if self.is_feedback and any(i["type"] == "function_call_output" for i in items):
                raise ValueError("feedback is kept out of history, so it cannot answer tool calls")
        if self.is_feedback and self.tools:
            raise ValueError("feedback is kept out of history, so its tool calls could never be answered")
        checked_choice(self.tool_choice, self.tools)
        if self.appended is not None and (self.history or (self.previous_response_id is None
                                                          and self.conversation_id is None)):
            raise ValueError("appended items follow previous_response_id or conversation_id (not history)")
        both = sorted(name for name in SAMPLING_FIELDS if getattr(self, name) is not None and name in self.options)
        if both:
            raise ValueError(f"{', '.join(both)} given both as a field and in options: give it once")
        return self

    def input_items(self) -> list[Item]:
        """The new input as items (prompt and messages are messages)."""
        if self.input is not None:
            return items_of(self.input)
        if self.prompt is not None:
            return [message("user", self.prompt)]
        return [message(m.role, m.content) for m in self.messages or []]

    def media_parts(self) -> list[tuple[str, dict[str, Any]]]:
        """The image and PDF parts of `input` with the field naming each (read and stored at admission)."""
        return media_parts(self.input) if self.input is not None else []

    def provider_options(self) -> dict[str, Any]:
        """`options` with the sampling fields given at the top level."""
        fields = {name: getattr(self, name) for name in SAMPLING_FIELDS if getattr(self, name) is not None}
        if "response_format" in fields:
            fields["response_format"] = self.response_format.model_dump(by_alias=True, exclude_none=True)  # type: ignore[union-attr]
        return {**self.options, **fields}

    def tool_fields(self) -> dict[str, Any]:
        """The tools, tool_choice and parallel_tool_calls a provider call carries (none without tools)."""
        if not self.tools:
            return {}
        choice = self.tool_choice
        return {"tools": [tool.stored() for tool in self.tools],
                "tool_choice": choice.model_dump() if isinstance(choice, BaseModel) else choice,
                "parallel_tool_calls": self.parallel_tool_calls}


class RequestRef(EventData):
    request_id: Text = Field(description="the id completion:async returned")


class CompletionWait(RequestRef):
    timeout: float = Field(default=60.0, ge=0, le=MAX_TIMEOUT, description="seconds to wait before replying with the status")


class CompletionStatus(RequestRef):
    pass


class CompletionCancel(RequestRef):
    pass
