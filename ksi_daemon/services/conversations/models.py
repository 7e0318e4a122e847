"""Payloads of the `conversation:*` events."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from ksi_common.items import Item, checked_exchange_items, message
from ksi_common.limits import INT64_MAX, MAX_TTL, MAX_TURN_CAP
from ksi_daemon.events import Door, EventData, ModelName, NonBlank, SafeId, Text


class ConversationRef(EventData):
    conversation_id: SafeId = Field(description="the conversation")


class ConversationList(EventData):
    agent_id: Text | None = Field(default=None, description="only conversations this agent owns or took part in")
    model: ModelName | None = Field(default=None, description="only conversations that used this model (glob allowed)")
    status: Literal["active", "archived", "expired"] | None = Field(default=None, description="active, archived or expired")
    tag: Text | None = Field(default=None, description="only conversations with this tag")
    text: Text | None = Field(default=None, min_length=1, description="only conversations whose title, inputs or replies contain this text (any case)")
    since: Text | None = Field(default=None, description="only conversations active at or after this ISO-8601 time")
    limit: int = Field(default=50, gt=0, le=1000, description="page size")
    offset: int = Field(default=0, ge=0, description="how many matches to skip")

    @field_validator("since")
    @classmethod
    def _since(cls, value: str | None) -> str | None:
        if value is not None:
            from ksi_common.timefmt import parse_ts

            try:
                parse_ts(value)
            except ValueError:
                raise ValueError("must be an ISO-8601 time such as 2026-01-02T03:04:05Z") from None
        return value


class ConversationShow(ConversationRef):
    inherited: bool = Field(default=True, description="include the exchanges shared with the fork chain")
    offset: int = Field(default=0, ge=0, description="skip this many exchanges")
    limit: int | None = Field(default=None, gt=0, description="at most this many exchanges")


class ConversationSent(ConversationRef):
    n: int = Field(gt=0, description="the exchange (numbered from 1, fork chain included)")


class ConversationStats(ConversationRef):
    pass


class ConversationUpdate(ConversationRef):
    title: Text | None = Field(default=None, description="a title; null clears it")
    tags: list[Text] | None = Field(default=None, description="the tags (replaces them)")
    ttl: float | None = Field(default=None, gt=0, le=MAX_TTL, description="seconds of inactivity before it expires; null: never")
    turn_cap: int | None = Field(default=None, gt=0, le=MAX_TURN_CAP, description="most exchanges it may hold; null: no cap")
    status: Literal["active", "archived"] | None = Field(default=None, description="active or archived")
    metadata: dict[str, Text] | None = Field(default=None, description="key-value pairs for clients (replaces them)")
    pins: list[int] | None = Field(default=None, max_length=256,
                                   description="the exchanges kept verbatim in every turn (replaces them); null: none")


class ConversationExport(ConversationRef):
    format: Literal["markdown", "json", "jsonl"] = Field(default="markdown", description="markdown, json or jsonl")
    inherited: bool = Field(default=True, description="include the exchanges shared with the fork chain")


class ConversationImport(EventData):
    data: str | dict[str, Any] | list[Any] = Field(description="a json or jsonl export (text or parsed)")
    format: Literal["json", "jsonl"] | None = Field(default=None, description="json or jsonl; guessed when absent")
    new_id: SafeId | None = Field(default=None, description="id of the new conversation (generated when absent)")
    title: Text | None = Field(default=None, description="title of the new conversation (the export's when absent)")
    origin: Door | None = Field(default=None, description="the door the import came through, recorded on it")
    continues: dict[str, Any] | None = Field(
        default=None, description="the conversation (and exchange) this history was found in, recorded in "
                                  "its metadata's extra when that one could not be continued")
    scope: dict[str, str] | None = Field(
        default=None, description="whom the history is for (agent_id, user, safety_identifier): only requests "
                                  "naming the same match it later")
    pending: list[NonBlank] = Field(default_factory=list, max_length=1000,
                                    description="user messages after the exchanges, without a reply yet: held as "
                                                "the new conversation's pending input, in the same write")
    metadata: dict[str, Any] | None = Field(default=None, description="the client's metadata, kept in its extras")
    for_run: bool = Field(default=False, description="made for a response whose history matched no stored "
                                                     "conversation (a session may take it over, see adoption)")


class ConversationFork(ConversationRef):
    at: int | None = Field(default=None, ge=0, le=INT64_MAX, description="share exchanges 1..at (default: all of them)")
    new_id: SafeId | None = Field(default=None, description="id of the fork (generated when absent)")
    title: Text | None = Field(default=None, description="title of the fork (the parent's when absent)")
    origin: Door | None = Field(default=None, description="the door the fork was asked through, recorded on it")
    digest: str | None = Field(default=None, max_length=128,
                               description="the chained digest of exchange `at` the caller found there (a matched "
                                           "history's): taken when the store agrees, so the parent is not read")


class ConversationArchive(ConversationRef):
    pass


class ConversationPin(ConversationRef):
    # bounded as a stored number is: an unpin of 10**20 would otherwise be saved as a no-op change
    n: list[Annotated[int, Field(ge=1, le=INT64_MAX)]] = Field(
        min_length=1, max_length=256, description="the exchanges (numbers) to pin or unpin")

    @field_validator("n", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, int | str) else value  # one number (a form posts text)


class ConversationDelete(ConversationRef):
    pass


class ResponseRef(EventData):
    response_id: SafeId = Field(description="the response (a Responses API id is a KSI response_id)")


class AppendedExchange(EventData):
    """An exchange a client already holds: its user texts and reply, or its items (a client's own
    tool turns: function calls and their outputs, reasoning)."""

    inputs: list[NonBlank] = Field(default_factory=list, description="the user inputs of the exchange")
    reply: Text = Field(default="", description="the assistant's reply to them")
    input: list[dict[str, Any]] | None = Field(
        default=None, min_length=1, max_length=1000,
        description="its input items instead of inputs: user messages and function_call_output items")
    output: list[dict[str, Any]] | None = Field(
        default=None, min_length=1, max_length=1000,
        description="its output items instead of reply: assistant messages, function_call and reasoning items")

    @model_validator(mode="after")
    def _one_form(self) -> AppendedExchange:
        if (self.input is None) == (not self.inputs) or (self.input is None) != (self.output is None):
            raise ValueError("give inputs and reply, or input and output items")
        if self.input is not None and self.output is not None:
            checked_exchange_items(self.input, self.output)
        return self

    def input_items(self) -> list[Item]:
        return list(self.input) if self.input is not None else [message("user", text) for text in self.inputs]

    def output_items(self) -> list[Item]:
        return list(self.output) if self.output is not None else [message("assistant", self.reply)]


class ConversationAppend(ConversationRef):
    exchanges: list[AppendedExchange] = Field(default_factory=list, max_length=1000,
                                              description="exchanges to add at the end, oldest first")
    reply_to_pending: Text | None = Field(
        default=None, description="the reply to the conversation's pending input: they become one exchange, "
                                  "added before `exchanges`")
    pending: list[NonBlank | dict[str, Any]] = Field(
        default_factory=list, max_length=1000,
        description="user messages (text) or function_call_output items after the exchanges, without a reply "
                    "yet: held as pending input in the same write (all of it, or nothing)")
    items: list[dict[str, Any]] | None = Field(
        default=None, min_length=1, max_length=1000,
        description="instead of the fields above, the items a client adds, of any type (user and assistant "
                    "messages, function_call, function_call_output, reasoning): those repeating the "
                    "conversation's newest items are already held; the others become exchanges, and user "
                    "messages after the last output item pending input")

    @field_validator("pending")
    @classmethod
    def _pending_outputs(cls, value: list[str | dict[str, Any]]) -> list[str | dict[str, Any]]:
        for item in value:
            if isinstance(item, dict):
                if item.get("type") != "function_call_output":
                    raise ValueError("a pending item is a user message's text or a function_call_output item")
                checked_exchange_items([item], [])
        return value

    @model_validator(mode="after")
    def _something(self) -> ConversationAppend:
        given = bool(self.exchanges) or self.reply_to_pending is not None or bool(self.pending)
        if given == (self.items is not None):
            raise ValueError("give items, or exchanges, reply_to_pending, pending or several")
        return self


class ConversationPend(ConversationRef):
    inputs: list[NonBlank] = Field(min_length=1, max_length=1000,
                                   description="user messages without a reply yet; the next request here takes them "
                                               "as its first input")


class ConversationAbandonCalls(ConversationRef):
    call_ids: list[NonBlank] | None = Field(
        default=None, min_length=1, max_length=1000,
        description="the open calls to abandon; null: every call the newest exchange left open")
