"""A Messages request as completion:async data. The turns up to the last assistant one are the
client's own history (matched to the conversation they belong to, as on the chat door); the user
turn after it is the new input. Fields map onto the event's own (tools, tool_choice, temperature,
max_tokens) or its provider options (stop_sequences as `stop`, top_k, thinking, metadata.user_id as
`user`, which also scopes the matching); fields this door does not declare go to the provider by
name under the rule every door shares."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.items import Item, message
from ksi_common.settings import Settings
from ksi_daemon.providers.base import calls_anthropic
from ksi_daemon.providers.options import check_request_options
from ksi_daemon.transports.http.anthropic.blocks import assistant_items, invalid, refused, system_text, user_items
from ksi_daemon.transports.http.anthropic.schemas import MessagesCreate
from ksi_daemon.transports.http.openai import tool_shapes
from ksi_daemon.transports.http.openai.image_refs import as_history
from ksi_daemon.transports.http.openai.translate import AGENT_PREFIX, renamed

# completion:async's field names in the Messages API's terms, for the errors it raises
FIELDS = {"prompt": "messages", "input": "messages", "history": "messages", "stop": "stop_sequences",
          "user": "metadata.user_id", "instructions": "system", "agent_id": "model",
          "anthropic_beta": "anthropic-beta"}
SERVER_TOOL = "is a server tool Anthropic runs; KSI runs client tools only (the client runs each call)"
CHOICES = {"auto": "auto", "any": "required", "none": "none"}


@dataclass(slots=True)
class Turns:
    """A request's messages as KSI needs them: the client's history and the new input, as items."""

    history: list[Item]
    new: list[Item]
    # completion:async's field of each new PDF's bytes (`input.N.content.M.file_data`) -> the block's
    pdf_fields: dict[str, str] = field(default_factory=dict)


def _answers(calls: list[Item], turn: list[Item], position: int, continuing: bool) -> None:
    """Every tool_result of a user turn answers a tool_use of the assistant turn before it, and every
    such call is answered there (Anthropic's rule). A first turn's results answer the stored
    conversation's calls only when the request names it (the engine checks those)."""
    made = {call["call_id"] for call in calls if call["type"] == "function_call"}
    answered = [item["call_id"] for item in turn if item["type"] == "function_call_output"]
    if not made and not answered:
        return  # most turns of a resent history: text alone, nothing to pair
    for call_id in answered:
        if call_id not in made and not (position == 0 and continuing):
            raise invalid(f"messages.{position}.content",
                          f"tool_result {call_id!r} answers no tool_use of the assistant turn before it")
    missing = sorted(made - set(answered))
    if missing:
        raise invalid(f"messages.{position}.content", f"the tool_use blocks {missing} of the assistant turn before "
                                                      "have no tool_result here")


def split_turns(body: MessagesCreate, continuing: bool) -> Turns:
    """`continuing`: the request names its conversation, so a first turn may answer its calls."""
    last = len(body.messages) - 1
    if body.messages[last].role != "user":
        raise refused(f"messages.{last}.role", "a prefilled assistant turn: KSI stores whole answers, so the "
                                               "last message must be the user's")
    history: list[Item] = []
    pending: list[Item] = []
    previous: list[Item] = []
    pdfs: dict[str, str] = {}
    for position, turn in enumerate(body.messages):
        where = f"messages.{position}.content"
        if turn.role == "assistant":
            history.extend(as_history(item) for item in pending)
            previous = assistant_items(turn.content, where)
            history.extend(previous)
            pending, pdfs = [], {}
            continue
        items, sources = user_items(turn.content, where)
        _answers(previous, items, position, continuing)
        previous = []
        said = len(pending) + len(items) - 1  # the turn's user message comes last
        pdfs.update({f"input.{said}.content.{part}.file_data": source for part, source in sources.items()})
        pending.extend(items)
    if not any(item["type"] == "function_call_output" or item["role"] == "user" for item in pending):
        raise invalid(f"messages.{last}.content", "the last user turn is empty")
    return Turns(history, pending, pdfs)


def tool_fields(body: MessagesCreate) -> dict[str, Any]:
    """Client tools as function tools; server tools refused by name."""
    fields: dict[str, Any] = {}
    tools = []
    for position, tool in enumerate(body.tools or []):
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise refused(f"tools.{position}.type", f"{kind} {SERVER_TOOL}")
        if not isinstance(tool.get("name"), str):
            raise invalid(f"tools.{position}.name", "a tool needs its name")
        tools.append({"type": "function", "name": tool["name"], "description": tool.get("description") or "",
                      "parameters": tool.get("input_schema") or {"type": "object", "properties": {}}})
    choice = body.tool_choice or {}
    kind = choice.get("type")
    if kind == "tool":
        fields["tool_choice"] = {"type": "function", "name": choice.get("name")}
    elif kind in CHOICES and (tools or kind != "auto"):
        fields["tool_choice"] = CHOICES[kind]
    elif kind is not None and kind not in CHOICES:
        raise invalid("tool_choice.type", "auto, any, tool or none")
    if choice.get("disable_parallel_tool_use") is True and tools:
        fields["parallel_tool_calls"] = False
    if tools:
        fields["tools"] = tools
    elif fields.get("tool_choice") == "none":
        del fields["tool_choice"]  # no tools: nothing to refrain from
    return fields


def unsent_fields(body: MessagesCreate, model: str) -> list[str]:
    """Fields kept from a provider that cannot take them: `thinking` (every Claude Code request
    carries it) to a model not called through Anthropic's API, where it fails the call itself. An
    answer names them in a header, so none is dropped silently."""
    wants = body.thinking is not None and body.thinking.get("type") != "disabled"
    return ["thinking"] if wants and not calls_anthropic(model) else []


def provider_options(body: MessagesCreate, model: str) -> dict[str, Any]:
    options = {name: value for name, value in (body.model_extra or {}).items() if value is not None}
    for name in ("container", "mcp_servers"):
        if name in options:
            raise refused(name, "Anthropic's servers run it; KSI sends the model only the conversation")
    if body.stop_sequences:
        options["stop"] = body.stop_sequences
    if body.top_k is not None:
        options["top_k"] = body.top_k
    if body.top_p is not None:
        options["top_p"] = body.top_p
    if body.thinking is not None and body.thinking.get("type") != "disabled" \
            and "thinking" not in unsent_fields(body, model):
        options["thinking"] = body.thinking
    if body.metadata is not None and body.metadata.user_id:
        options["user"] = body.metadata.user_id
    if not options:
        return options  # most requests: nothing to check, and the check validates a model
    try:
        return check_request_options(options, where="options.")
    except KsiError as error:
        raise renamed(error, FIELDS) from None


def messages_payload(body: MessagesCreate, turns: Turns, settings: Settings, conversation_id: str | None,
                     beta: list[str]) -> dict[str, Any]:
    """POST /v1/messages as completion:async data (the errors it raises name the body's fields);
    `turns`: its messages (see split_turns); `beta`: the anthropic-beta header's names."""
    payload: dict[str, Any] = {**tool_shapes.new_input(turns.new), **tool_fields(body), "origin": "http",
                               "max_tokens": body.max_tokens}
    model = settings.aliased(body.model)
    payload["agent_id" if model.startswith(AGENT_PREFIX) else "model"] = model.removeprefix(AGENT_PREFIX)
    system = system_text(body.system)
    if turns.history:
        # the history's own system prompt, as a chat history's leading system message
        payload["history"] = ([message("system", system)] if system else []) + turns.history
    elif system is not None:
        payload["system"] = system
    if conversation_id is not None:
        payload["conversation_id"] = conversation_id
    if body.temperature is not None:
        payload["temperature"] = body.temperature
    if beta:
        payload["anthropic_beta"] = beta
    options = provider_options(body, model)
    if options:
        payload["options"] = options
    return payload


def in_block_terms(error: KsiError, turns: Turns) -> KsiError:
    """`error` naming a PDF's bytes by the field of the document block they came in (the daemon,
    which checks them for every client, names the `input_file` part it was given)."""
    fields = error.details.get("fields")
    if not isinstance(fields, dict) or not any(key in turns.pdf_fields for key in fields):
        return error
    message = error.message
    for key in fields:
        message = message.replace(key, turns.pdf_fields.get(key, key))
    mapped = {turns.pdf_fields.get(key, key): value for key, value in fields.items()}
    return KsiError(error.code, message, **{**error.details, "fields": mapped})


def in_client_terms(error: KsiError) -> KsiError:
    """An engine error naming completion:async's fields, named in the Messages API's."""
    if error.code == ErrorCode.VALIDATION_ERROR or isinstance(error.details.get("fields"), dict):
        return renamed(error, FIELDS)
    return error
