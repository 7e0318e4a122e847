"""A conversation's pending input: user messages a client added that have no reply yet (the
Conversations API adds the user's item before it asks for a response). They are kept in the
conversation's metadata, so they survive a restart on every backend, and the next request on the
conversation takes them as its first input; the exchange that answers them clears them, in the
same write as its index line."""

from __future__ import annotations

from typing import Any

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.ids import new_id
from ksi_daemon.services.conversations.response_lines import message_line
from ksi_daemon.storage.models import ConversationMeta

PENDING_KEY = "pending_input"  # in the metadata's extra: [{"id", "content", "ts"}], oldest first
MAX_PENDING = 1000  # messages one conversation may hold without a reply


def pending_of(meta: ConversationMeta) -> list[dict[str, Any]]:
    return list(meta.extra.get(PENDING_KEY) or [])


def pended(conversation_id: str, extra: dict[str, Any], texts: list[str], now: str, field: str
           ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """`extra` (a conversation's metadata extras) with `texts` added to its pending input, and the
    messages added; refused, naming `field`, when it would hold more than `MAX_PENDING`. Checked
    before anything is written, so the event adding them writes all it was given or nothing."""
    pending = list(extra.get(PENDING_KEY) or [])
    if len(pending) + len(texts) > MAX_PENDING:
        raise KsiError(ErrorCode.VALIDATION_ERROR,
                       f"conversation {conversation_id} would hold more than {MAX_PENDING} messages without a reply",
                       fields={field: f"at most {MAX_PENDING} pending messages"}, pending=len(pending))
    added = [{"id": new_id("pend-"), "content": text, "ts": now} for text in texts]
    return {**extra, PENDING_KEY: [*pending, *added]}, added


def with_pending(meta: ConversationMeta, inputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's input lines with the conversation's pending messages before its own user input
    (after a system line it sets), each line naming the pending message it came from."""
    pending = pending_of(meta)
    if not pending:
        return inputs
    at = next((i for i, line in enumerate(inputs) if line.get("type") != "system"), len(inputs))
    model = next((line for line in inputs if line.get("type") != "system"), inputs[0] if inputs else {})
    shared = {key: model[key] for key in ("request_id", "conversation_id", "agent_id") if key in model}
    lines = [message_line("user", item["content"], item["ts"], **shared, pending_id=item["id"]) for item in pending]
    return [*inputs[:at], *lines, *inputs[at:]]


def without_consumed(meta: ConversationMeta, inputs: list[dict[str, Any]]) -> ConversationMeta:
    """`meta` without the pending messages `inputs` took (a copy; any added since are kept)."""
    taken = {line["pending_id"] for line in inputs if line.get("pending_id")}
    if not taken:
        return meta
    left = [item for item in pending_of(meta) if item["id"] not in taken]
    extra = {key: value for key, value in meta.extra.items() if key != PENDING_KEY}
    if left:
        extra[PENDING_KEY] = left
    return meta.model_copy(update={"extra": extra})
