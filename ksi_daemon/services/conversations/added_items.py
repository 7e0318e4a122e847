"""Items a client adds to a conversation (the Conversations API's `items`), of any type, as the
exchanges and pending input `conversation:append` writes.

A client that keeps its session in a conversation (the Agents SDKs' `OpenAIConversationsSession`)
adds each run's new items after the run: its tool calls, their outputs and the answer, which the
responses of that run already stored there. Items repeating the conversation's newest items are
therefore already held and added again nowhere; the others become exchanges (the input items
before each run of output items), and user messages after the last output item wait, as pending
input, for the next response."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ksi_common import items
from ksi_common.errors import ErrorCode, KsiError
from ksi_daemon.services.conversations.client_items import OUTPUT_KINDS, normalised
from ksi_daemon.services.conversations.models import AppendedExchange

FIELD = "items"


def item_key(item: items.Item) -> Any:
    """What two items are compared by: their canonical form (a reasoning item by its type alone)."""
    return items.canonical_item(item) or {"type": item.get("type", "message"), "role": item.get("role")}


def not_held(tail: list[items.Item], added: list[items.Item]) -> int:
    """How many leading items of `added` the conversation's newest items (`tail`) end with."""
    for length in range(min(len(added), len(tail)), 0, -1):
        if [item_key(i) for i in added[:length]] == [item_key(i) for i in tail[-length:]]:
            return length
    return 0


def _invalid(where: str, why: str) -> KsiError:
    return KsiError(ErrorCode.VALIDATION_ERROR, f"{where}: {why}", fields={where: why})


@dataclass(slots=True)
class AddedItems:
    """What `conversation:append` writes for the items not held yet."""

    exchanges: list[AppendedExchange] = field(default_factory=list)
    reply_to_pending: str | None = None
    pending: list[str | items.Item] = field(default_factory=list)


def _is_output(item: items.Item) -> bool:
    return item["type"] in OUTPUT_KINDS or item.get("role") == "assistant"


def added_items(raw: list[dict[str, Any]], start: int, holds_pending: bool) -> AddedItems:
    """`raw[start:]` (the items not held) as exchanges and pending input; output items before any
    input answer the pending input (one assistant message, as a client adds a reply it got)."""
    found = [(position, normalised(raw[position], f"{FIELD}.{position}")) for position in range(start, len(raw))]
    added = AddedItems()
    inputs: list[items.Item] = []
    outputs: list[items.Item] = []
    for position, item in found:
        if item["type"] == "message" and item["role"] == "system":
            raise _invalid(f"{FIELD}.{position}.role", "system items can only start a conversation")
        if _is_output(item):
            if inputs:
                outputs.append(item)
                continue
            if (holds_pending and not added.exchanges and added.reply_to_pending is None
                    and item["type"] == "message" and isinstance(item["content"], str)):
                added.reply_to_pending = item["content"]
                continue
            raise _invalid(f"{FIELD}.{position}", "output items must follow the input they answer")
        if outputs:
            added.exchanges.append(AppendedExchange(input=inputs, output=outputs))
            inputs, outputs = [], []
        inputs.append(item)
    if outputs:
        added.exchanges.append(AppendedExchange(input=inputs, output=outputs))
        inputs = []
    for position, item in zip(range(len(raw) - len(inputs), len(raw)), inputs, strict=True):
        if item["type"] == "function_call_output":
            added.pending.append(item)  # waits, as a user message does, for the response answering it
        elif not isinstance(item["content"], str) or not item["content"].strip():
            raise _invalid(f"{FIELD}.{position}", "a user message waiting for a response is non-empty text")
        else:
            added.pending.append(item["content"])
    return added


def check_open_calls(outputs: list[items.Item], made: list[items.Item], first: int) -> None:
    """Pending call outputs answer calls of `made` (the newest output items), each once; `first`:
    where the pending items start among the items sent."""
    open_ids = {str(call["call_id"]) for call in items.function_calls(made)}
    seen: set[str] = set()
    for position, output in enumerate(outputs, start=first):
        call_id = str(output.get("call_id"))
        if call_id not in open_ids or call_id in seen:
            raise _invalid(f"{FIELD}.{position}.call_id", f"{call_id!r} answers no open call of the conversation")
        seen.add(call_id)
