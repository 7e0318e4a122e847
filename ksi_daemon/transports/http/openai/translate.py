"""OpenAI request bodies as KSI event payloads, and KSI's field names back in OpenAI's terms."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.items import Item
from ksi_common.items import message as message_item
from ksi_common.settings import Settings
from ksi_daemon.providers.options import check_request_options
from ksi_daemon.transports.http.door import RequestHandler, read_json
from ksi_daemon.transports.http.openai import tool_shapes
from ksi_daemon.transports.http.openai.image_refs import as_history
from ksi_daemon.transports.http.openai.response_object import ksi_id
from ksi_daemon.transports.http.openai.schemas import (
    Body,
    ChatCompletionCreate,
    FunctionCallOutput,
    InputMessage,
    ResponseCreate,
    parse,
    with_breakpoint,
)
from ksi_daemon.transports.http.openai.shapes import output_item_response

AGENT_PREFIX = "agent/"
HISTORY_HEADER = "X-KSI-History"  # client: the client's own history was sent; stored: KSI's rebuild


def history_used(result: dict[str, Any]) -> str | None:
    """Which history the provider received for a request that sent its own (None: it sent none)."""
    source = (result.get("history") or {}).get("source")
    return str(source) if source else None


@dataclass(slots=True)
class Door:
    """What every OpenAI route handler holds: the daemon's request function and settings."""

    handle_request: RequestHandler
    settings: Settings
    background: set[Any] = field(default_factory=set)  # tasks a handler started and must not lose

    async def body(self, request: Request, model: type[Body]) -> Any:
        return parse(model, await read_json(request, self.settings.line_limit))


def renamed(error: KsiError, names: dict[str, str], positions: list[int] | None = None) -> KsiError:
    """`error` with the fields it names given in the client's terms (`prompt` -> `input`,
    `options.response_format` -> `text.format`); `positions`: where each new input item stands in
    the body (completion:async numbers `input` from the new input, after the client's history)."""
    fields = error.details.get("fields")
    if not isinstance(fields, dict):
        return error
    mapped = {}
    message = error.message
    for key, value in fields.items():
        key = key.removeprefix("options.")  # the door's options are the body's own fields
        head, dot, rest = key.partition(".")
        index, _, tail = rest.partition(".")
        if head in ("input", "messages") and positions and index.isdigit() and int(index) < len(positions):
            renumbered = f"{positions[int(index)]}" + (f".{tail}" if tail else "")
            message = message.replace(key, f"{names.get(head, head)}.{renumbered}")
            rest = renumbered
        mapped[names.get(head, head) + dot + rest] = _in_client_terms(value, names) if isinstance(value, str) else value
    return KsiError(error.code, _in_client_terms(message, names), **{**error.details, "fields": mapped})


def _in_client_terms(text: str, names: dict[str, str]) -> str:
    for old, new in names.items():
        # a field leads its part of the message ("invalid data: prompt: ...; history: ..."); the
        # same word inside a sentence ("a data: URL") is the sentence's own
        text = re.sub(rf"(^|invalid |: |; ){re.escape(old)}:", rf"\g<1>{new}:", text)
        if "_" in old:  # a field's name inside a sentence ("give conversation_id or ..."), not a plain word
            text = re.sub(rf"\b{re.escape(old)}\b", new, text)
    return text


def new_input_positions(body: ResponseCreate) -> list[int]:
    """Where each new input item of a Responses body stands in its `input` (after the history)."""
    if isinstance(body.input, str):
        return [0]
    last_reply = max((p for p, m in enumerate(body.input) if tool_shapes.is_output_item(m)), default=-1)
    return list(range(last_reply + 1, len(body.input)))


RESPONSE_FIELDS = {"prompt": "input", "messages": "input", "max_tokens": "max_output_tokens",
                   "conversation_id": "conversation", "agent_id": "model", "data": "input",
                   "response_format": "text.format", "reasoning_effort": "reasoning.effort", "history": "input",
                   "appended": "input", "verbosity": "text.verbosity"}
CHAT_FIELDS = {"prompt": "messages", "max_tokens": "max_tokens", "data": "messages", "history": "messages",
               "input": "messages"}


def _model_fields(payload: dict[str, Any], model: str | None) -> None:
    if model and model.startswith(AGENT_PREFIX):
        payload["agent_id"] = model[len(AGENT_PREFIX):]  # the agent's profile supplies model and system
    elif model:
        payload["model"] = model


def _extra_fields(body: ResponseCreate | ChatCompletionCreate) -> dict[str, Any]:
    """Fields the door does not declare: they go to the provider by name, like the socket's options
    (refused ones, such as tools or n > 1, are refused by the same rule there)."""
    return {name: value for name, value in (body.model_extra or {}).items() if value is not None}


def _checked(options: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """`options` under the one rule of every door, before anything is written (a chat history is
    imported before its completion is asked for); errors name the client's fields."""
    try:
        return check_request_options(options, where="options.")
    except KsiError as error:
        raise renamed(error, names) from None


def _not_empty(content: str | list[dict[str, Any]], where: str) -> None:
    """New input says something: text that is not blank, or an image."""
    if isinstance(content, str) and not content.strip() or isinstance(content, list) and not content:
        raise KsiError(ErrorCode.VALIDATION_ERROR, f"{where} is empty", fields={where: "must not be empty"})


def _refuse(field_name: str, why: str) -> KsiError:
    return KsiError(ErrorCode.UNSUPPORTED_PARAMETER, f"{field_name} is not supported: {why}",
                    fields={field_name: why})


# what `include` may ask: the reasoning a provider returned, as the opaque string a client sends back
INCLUDABLE = frozenset({"reasoning.encrypted_content"})


def response_options(body: ResponseCreate) -> dict[str, Any]:
    """The provider options of a Responses request: its sampling and format fields mapped onto
    completion:async's `options`, what it refuses refused."""
    unknown = sorted(set(body.include or ()) - INCLUDABLE)
    if unknown:
        raise _refuse("include", f"{', '.join(unknown)}: a KSI response can include "
                                 f"{', '.join(sorted(INCLUDABLE))} only")
    options = _extra_fields(body)
    text_format = body.text.format if body.text is not None else None
    for key, value in (("top_p", body.top_p), ("seed", body.seed), ("user", body.user),
                       ("response_format", text_format.response_format() if text_format else None),
                       ("reasoning_effort", body.reasoning.effort if body.reasoning is not None else None),
                       ("verbosity", body.text.verbosity if body.text is not None else None),
                       ("truncation", body.truncation)):
        if value is not None:
            options[key] = value
    return _checked(options, RESPONSE_FIELDS)


def continued_at(body: ResponseCreate) -> tuple[int, str] | None:
    """Where a client-held history names a stored response, and which: its newest output item
    (an assistant message, a call, a reasoning item or a reference to one) carrying an id this
    door gave (an SDK keeps the items it was sent, ids and all; the Vercel AI SDK sends references
    to them). Such an item stands for the stored one, as an item id does for OpenAI: the history
    up to it is that response's conversation, and what follows it is added after that response."""
    if isinstance(body.input, str) or body.previous_response_id is not None or body.conversation is not None:
        return None
    last_reply = max((p for p, m in enumerate(body.input) if tool_shapes.is_output_item(m)), default=-1)
    for position in range(last_reply, -1, -1):
        item = body.input[position]
        if tool_shapes.is_output_item(item) and not isinstance(item, FunctionCallOutput):
            response_id = output_item_response(item.id)  # type: ignore[union-attr]
            if response_id is not None:
                return position, response_id
    return None


def continued_response(body: ResponseCreate) -> str | None:
    """The KSI response a client-held history is continued after (see continued_at)."""
    found = continued_at(body)
    return found[1] if found is not None else None


def dropped_tools(body: ResponseCreate, settings: Settings) -> frozenset[str]:
    """The hosted tool types the settings of the request's model leave out (drop_hosted_tools)."""
    model = body.model or settings.default_model
    if model.startswith(AGENT_PREFIX):
        return frozenset()
    return frozenset(settings.model_settings(model).drop_hosted_tools)


def response_payload(body: ResponseCreate, after: str | None = None,
                     dropped: frozenset[str] = frozenset()) -> dict[str, Any]:
    """POST /v1/responses as completion:async data; `after`: the response its history ends with
    (see continued_response), whose conversation stands for the history; `dropped`: the hosted
    tool types left out (see dropped_tools)."""
    payload: dict[str, Any] = {"origin": "http"}
    options = {**response_options(body), **tool_shapes.search_options(body, dropped)}
    tools = tool_shapes.tool_fields(body, dropped, searched=True)
    names = tool_shapes.tool_names(tools)
    if isinstance(body.input, str):
        payload["prompt"] = body.input
    else:
        # a list holding assistant items (or calls) carries the client's own history: everything up
        # to the last of them is history (matched to its conversation), what follows is new
        last_reply = max((p for p, m in enumerate(body.input) if tool_shapes.is_output_item(m)), default=-1)
        # after a stored point, the items before the new input follow it (as OpenAI takes them)
        anchored = body.previous_response_id is not None or body.conversation is not None or after is not None
        stands_for = continued_at(body) if after is not None else None
        history: list[Item] = []
        messages: list[Item] = []
        for position, message in enumerate(body.input):
            if position <= last_reply:
                if stands_for is not None and position <= stands_for[0]:
                    continue  # the stored conversation up to `after` is this history
                item = (tool_shapes.appended_item(position, message, names) if anchored
                        else tool_shapes.history_item(position, message, names))
                if item is not None:
                    history.append(item)
                continue
            if not isinstance(message, InputMessage):
                messages.append(tool_shapes.response_input_item(position, message))
                continue
            content = message.event_content(f"input.{position}.content")
            _not_empty(content, f"input.{position}.content")
            messages.append(with_breakpoint(message_item("user" if message.role == "user" else "system", content),
                                            message.content))
        if history:
            payload["appended" if anchored else "history"] = history
        if not any(m["type"] == "function_call_output" or m["role"] == "user" for m in messages):
            raise KsiError(ErrorCode.VALIDATION_ERROR,
                           "input must end with a user message or a call's output (the new input)",
                           fields={"input": "no user message or call output after the last assistant item"})
        payload.update(tool_shapes.new_input(messages))
    payload.update(tools)
    _model_fields(payload, body.model)
    previous = ksi_id(body.previous_response_id) if body.previous_response_id is not None else after
    if after is not None:
        payload["previous_by_item"] = True  # an item's id: another scope's response is not continued
    for key, value in (("instructions", body.instructions), ("previous_response_id", previous),
                       ("conversation_id", body.conversation_id()), ("temperature", body.temperature),
                       ("max_tokens", body.max_output_tokens), ("metadata", body.metadata),
                       ("options", options)):
        if value is not None and value != {}:
            payload[key] = value
    return payload


@dataclass(slots=True)
class ChatInput:
    """A chat request's messages split into what KSI needs: the client's own earlier turns (as
    items, its leading system messages first), the system prompt, and the new input (user and
    system messages, and the outputs of the calls the last assistant message made)."""

    system: str | None
    history: list[Item]  # every message up to the last assistant one, its tool calls as items
    new: list[Item]
    options: dict[str, Any]
    positions: list[int]  # where each of `new` stands in the body's messages


def split_chat(body: ChatCompletionCreate) -> ChatInput:
    system = None
    history: list[Item] = []
    pending: list[Item] = []
    positions: list[int] = []
    calls = tool_shapes.ChatCalls()
    options = _extra_fields(body)  # seed, stop, response_format, n, ...: OpenAI's names are the options'
    if body.top_p is not None:
        options["top_p"] = body.top_p
    options = _checked(options, CHAT_FIELDS)
    for position, message in enumerate(body.messages):
        if message.role == "function" or message.function_call:
            # the deprecated form of tool calls: its replies have no call ids to answer
            called = "role" if message.role == "function" else "function_call"
            raise _refuse(f"messages.{position}.{called}", "functions are called through tools and tool_calls")
        if message.role == "tool":
            pending.append(calls.answer(message, position))
            positions.append(position)
            continue
        calls.check_answered(position)
        if message.role == "assistant":
            text = message.text(f"messages.{position}.content")
            if not history and system is not None:
                history.append(message_item("system", system))
            made = tool_shapes.chat_calls_as_items(message.tool_calls or [], f"messages.{position}.tool_calls")
            history.extend(as_history(item) for item in pending)
            history.extend([message_item("assistant", text)] if text or not made else [])
            history.extend(made)
            calls.called(made)
            pending, positions = [], []
            continue
        if message.role in ("system", "developer") and not history and not pending:
            text = message.text(f"messages.{position}.content")
            system = text if system is None else f"{system}\n\n{text}"
            continue
        content = message.event_content(f"messages.{position}.content")
        _not_empty(content, f"messages.{position}.content")
        pending.append(with_breakpoint(message_item("user" if message.role == "user" else "system", content),
                                       message.content))
        positions.append(position)
    if not any(item["type"] == "function_call_output" or item["role"] == "user" for item in pending):
        raise KsiError(ErrorCode.VALIDATION_ERROR,
                       "the last messages must include a user message or tool results (the new input)",
                       fields={"messages": "no new user or tool message after the last assistant message"})
    return ChatInput(system, history, pending, options, positions)


def chat_payload(body: ChatCompletionCreate, chat: ChatInput, conversation_id: str | None) -> dict[str, Any]:
    payload: dict[str, Any] = {**tool_shapes.new_input(chat.new), **tool_shapes.tool_fields(body), "origin": "http"}
    if chat.history:
        payload["history"] = chat.history  # matched to the conversation it belongs to
    _model_fields(payload, body.model)
    if conversation_id is not None:
        payload["conversation_id"] = conversation_id
        if body.create:
            payload["create"] = True
    if chat.system is not None and not chat.history:
        payload["system"] = chat.system  # with history, its leading system message is the history's
    max_tokens = body.max_completion_tokens or body.max_tokens
    for key, value in (("temperature", body.temperature), ("max_tokens", max_tokens), ("metadata", body.metadata),
                       ("options", chat.options)):
        if value is not None and value != {}:
            payload[key] = value
    return payload
