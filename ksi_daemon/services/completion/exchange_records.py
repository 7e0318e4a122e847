"""What one exchange writes: its response-file lines, its metadata update and its result."""

from __future__ import annotations

from typing import Any

from ksi_common.errors import KsiError
from ksi_common.events import completion_result
from ksi_common.items import Item, item_text
from ksi_common.records import IndexEntry
from ksi_common.timefmt import utc_now
from ksi_daemon.providers.base import ProviderReply
from ksi_daemon.providers.options import kept_options
from ksi_daemon.services.completion.models import CompletionAsync
from ksi_daemon.services.completion.requests import RequestState
from ksi_daemon.services.conversations import response_lines
from ksi_daemon.services.conversations.memory import exchange_input
from ksi_daemon.storage.models import CliSession, ConversationMeta, SystemChange, preview_of


def input_lines(state: RequestState) -> list[dict[str, Any]]:
    """The request's raw inputs as response-file lines (never the expanded history)."""
    data = state.request
    ids: dict[str, Any] = {"request_id": state.request_id, "conversation_id": state.conversation_id}
    if state.agent_id:
        ids["agent_id"] = state.agent_id
    if state.from_agent:
        ids["from_agent"] = state.from_agent
    return response_lines.request_lines(data.input_items(), is_feedback=data.is_feedback, system=data.system,
                                        ts=state.created, ids=ids, metadata=data.metadata,
                                        files=data.files, images=state.images,
                                        options=kept_options(data.provider_options()))


def first_input_preview(data: CompletionAsync) -> str | None:
    """What lists show for a conversation this request starts: the start of its user input."""
    items = data.input_items()
    first = next((item_text(i) for i in items if i["type"] == "message" and i["role"] == "user"), None)
    if first is None:  # a turn of tool outputs alone
        first = next((item_text(i) for i in items), None)
    return preview_of(first) if first is not None else None


def new_items(inputs: list[dict[str, Any]]) -> list[Item]:
    """The new input as the model sees it: input items without the system prompt (kept in the
    metadata), a message from an agent marked as such."""
    return [item for item in exchange_input(inputs) if item.get("role") != "system"]


def outcome_line(state: RequestState, reply: ProviderReply, attempts: list[dict[str, Any]],
                 duration_ms: float, ts: str, sent: dict[str, Any] | None = None) -> dict[str, Any]:
    line = response_lines.answer_line(reply.items(), {
        "model": state.model, "provider": reply.provider, "usage": reply.usage, "cost": reply.cost,
        "finish_reason": reply.finish_reason, "duration_ms": duration_ms,
        "provider_response_id": reply.provider_response_id, "attempts": attempts, "ts": ts,
        "request_id": state.request_id, "conversation_id": state.conversation_id,
    })
    if reply.cost_uncached is not None:
        line["cost_uncached"] = reply.cost_uncached  # what the cache saved is the difference
    if state.request.instructions is not None:
        line["instructions"] = state.request.instructions  # the system prompt of this exchange alone
    if sent is not None:
        line["sent"] = sent  # with the index, enough to show later exactly what the model was sent
    if reply.session_id:
        line["session_id"] = reply.session_id
    if reply.session_note:
        line["session_note"] = reply.session_note
    for key, value in reply.extra.items():
        line.setdefault(key, value)
    return line


def error_line(state: RequestState, error: KsiError, attempts: list[dict[str, Any]]) -> dict[str, Any]:
    return response_lines.error_line(error.code, error.message, error.details, {
        "model": state.model, "attempts": attempts, "duration_ms": state.duration_ms(), "ts": utc_now(),
        "request_id": state.request_id, "conversation_id": state.conversation_id})


def updated_meta(meta: ConversationMeta, state: RequestState, reply: ProviderReply, entry: IndexEntry,
                 new_system: str | None, system_changed: bool, now: str) -> ConversationMeta:
    """The conversation's metadata after this exchange (a copy; the caller saves it)."""
    # one shallow copy with every change in it (each attribute set on a model afterwards is two
    # Python calls); a list that changes is a new list, so the old metadata keeps its own
    models = [m for m in meta.models if m != state.model]
    models.append(state.model)  # the last one used is last
    update: dict[str, Any] = {
        "exchanges": meta.exchanges + 1,
        "tokens_in": meta.tokens_in + reply.usage.get("prompt_tokens", 0),
        "tokens_out": meta.tokens_out + reply.usage.get("completion_tokens", 0),
        "cost": meta.cost + (reply.cost or 0.0),
        "last_activity": now,
        "models": models,
        "cli_session": (CliSession(model=state.model, session_id=reply.session_id, n=entry.n)
                        if reply.session_id else None),
    }
    if entry.n == 1 and meta.preview is None:  # created before its first input (an agent's, an empty fork)
        update["preview"] = first_input_preview(state.request)
    if system_changed:
        update["system_changes"] = [*meta.system_changes,
                                    SystemChange(from_n=entry.n, system=new_system, ts=entry.ts or now)]
        update["system"] = new_system
    return meta.model_copy(update=update)


def result_data(state: RequestState, reply: ProviderReply, entry: IndexEntry, history: dict[str, Any],
                attempts: int, duration_ms: float, turns_left: int | None = None) -> dict[str, Any]:
    """The data of completion:result (and of a successful completion:wait); `turns_left` is how
    many more exchanges the conversation's cap allows (None: no cap)."""
    result = completion_result(
        request_id=state.request_id, response_id=state.response_id, conversation_id=state.conversation_id,
        agent_id=state.agent_id, model=state.model, content=reply.content, output=reply.items(),
        finish_reason=reply.finish_reason, usage=reply.usage, cost=reply.cost, history=history,
        attempts=attempts, duration_ms=duration_ms, exchange=entry.n, turns_left=turns_left)
    if reply.session_note:
        result["session_note"] = reply.session_note
    for key, value in reply.extra.items():
        result.setdefault(key, value)
    return result
