"""OpenAI request bodies as KSI event payloads, and KSI's field names back in OpenAI's terms."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.settings import Settings
from ksi_daemon.transports.http.door import RequestHandler, read_json
from ksi_daemon.transports.http.openai.schemas import Body, ChatCompletionCreate, ResponseCreate, parse

AGENT_PREFIX = "agent/"


@dataclass(slots=True)
class Door:
    """What every OpenAI route handler holds: the daemon's request function and settings."""

    handle_request: RequestHandler
    settings: Settings
    background: set[Any] = field(default_factory=set)  # tasks a handler started and must not lose

    async def body(self, request: Request, model: type[Body]) -> Any:
        return parse(model, await read_json(request, self.settings.line_limit))


def renamed(error: KsiError, names: dict[str, str]) -> KsiError:
    """`error` with the fields it names given in the client's terms (`prompt` -> `input`)."""
    fields = error.details.get("fields")
    if not isinstance(fields, dict):
        return error
    mapped = {}
    for key, value in fields.items():
        head, dot, rest = key.partition(".")
        mapped[names.get(head, head) + dot + rest] = value
    message = error.message
    for old, new in names.items():
        message = message.replace(f"{old}:", f"{new}:")
    return KsiError(error.code, message, **{**error.details, "fields": mapped})


RESPONSE_FIELDS = {"prompt": "input", "messages": "input", "max_tokens": "max_output_tokens",
                   "conversation_id": "conversation", "agent_id": "model", "data": "input"}
CHAT_FIELDS = {"prompt": "messages", "max_tokens": "max_tokens", "data": "messages"}


def _model_fields(payload: dict[str, Any], model: str | None) -> None:
    if model and model.startswith(AGENT_PREFIX):
        payload["agent_id"] = model[len(AGENT_PREFIX):]  # the agent's profile supplies model and system
    elif model:
        payload["model"] = model


def response_payload(body: ResponseCreate) -> dict[str, Any]:
    """POST /v1/responses as completion:async data."""
    payload: dict[str, Any] = {"origin": "http"}
    if isinstance(body.input, str):
        payload["prompt"] = body.input
    else:
        messages = []
        for position, message in enumerate(body.input):
            if message.role == "assistant":
                raise KsiError(ErrorCode.VALIDATION_ERROR,
                               "input holds an assistant message: the history comes from previous_response_id "
                               "or conversation, the input is only what is new",
                               fields={f"input.{position}.role": "assistant messages are not new input"})
            text = message.text()
            if not text.strip():
                raise KsiError(ErrorCode.VALIDATION_ERROR, f"input.{position}.content is empty",
                               fields={f"input.{position}.content": "must not be empty"})
            messages.append({"role": "user" if message.role == "user" else "system", "content": text})
        payload["messages"] = messages
    _model_fields(payload, body.model)
    options = {"top_p": body.top_p} if body.top_p is not None else {}
    for key, value in (("instructions", body.instructions), ("previous_response_id", body.previous_response_id),
                       ("conversation_id", body.conversation_id()), ("temperature", body.temperature),
                       ("max_tokens", body.max_output_tokens), ("metadata", body.metadata),
                       ("options", options)):
        if value is not None and value != {}:
            payload[key] = value
    return payload


@dataclass(slots=True)
class ChatInput:
    """A chat request's messages split into what KSI needs: earlier exchanges (only when the client
    sends its own history without a conversation), the system prompt, and the new input."""

    system: str | None
    history: list[tuple[list[str], str]]  # (user texts, assistant reply) per earlier exchange
    new: list[dict[str, str]]


def split_chat(body: ChatCompletionCreate, conversation_id: str | None) -> ChatInput:
    system = None
    history: list[tuple[list[str], str]] = []
    pending: list[dict[str, str]] = []
    for position, message in enumerate(body.messages):
        if message.role == "tool":
            raise KsiError(ErrorCode.VALIDATION_ERROR, "tool messages are not supported",
                           fields={f"messages.{position}.role": "tool messages are not supported"})
        text = message.text()
        if message.role == "assistant":
            if conversation_id is not None:
                raise KsiError(ErrorCode.VALIDATION_ERROR,
                               "with a conversation, send only the new input: KSI rebuilds the history",
                               fields={f"messages.{position}.role": "no assistant messages with a conversation"})
            history.append(([m["content"] for m in pending if m["role"] == "user"], text))
            pending = []
            continue
        if message.role in ("system", "developer") and not history and not any(m["role"] == "user" for m in pending):
            system = text if system is None else f"{system}\n\n{text}"
            continue
        if not text.strip():
            raise KsiError(ErrorCode.VALIDATION_ERROR, f"messages.{position}.content is empty",
                           fields={f"messages.{position}.content": "must not be empty"})
        pending.append({"role": "user" if message.role == "user" else "system", "content": text})
    if not any(m["role"] == "user" for m in pending):
        raise KsiError(ErrorCode.VALIDATION_ERROR, "the last messages must include a user message (the new input)",
                       fields={"messages": "no new user message after the last assistant message"})
    return ChatInput(system, history, pending)


def chat_payload(body: ChatCompletionCreate, chat: ChatInput, conversation_id: str | None) -> dict[str, Any]:
    payload: dict[str, Any] = {"messages": chat.new, "origin": "http"}
    _model_fields(payload, body.model)
    if conversation_id is not None:
        payload["conversation_id"] = conversation_id
        if body.create:
            payload["create"] = True
    if chat.system is not None and not chat.history:
        payload["system"] = chat.system  # with history, the imported conversation carries it
    max_tokens = body.max_completion_tokens or body.max_tokens
    for key, value in (("temperature", body.temperature), ("max_tokens", max_tokens), ("metadata", body.metadata)):
        if value is not None:
            payload[key] = value
    if body.top_p is not None:
        payload["options"] = {"top_p": body.top_p}
    return payload


def history_document(chat: ChatInput) -> dict[str, Any]:
    """The client's own earlier exchanges as a conversation export, for conversation:import."""
    return {
        "format": "ksi.conversation", "v": 1,
        "conversation": {"system": chat.system},
        "exchanges": [
            {"inputs": [{"type": "user", "content": text} for text in users], "reply": {"content": reply}}
            for users, reply in chat.history
        ],
    }
