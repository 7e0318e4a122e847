"""A conversation's pending input: user messages a client added that have no reply yet (the
Conversations API adds the user's item before it asks for a response). They are kept in the
conversation's metadata (`ConversationMeta.pending_input`), so they survive a restart on every backend, and the next request on the
conversation takes them as its first input; the exchange that answers them clears them, in the
same write as its index line.

A client that keeps its session in a conversation (openai-agents' `OpenAIConversationsSession`)
adds its user item there, then asks for a response with its whole history and no conversation:
such a request, whose history and new input are a conversation's exchanges and pending input,
continues that conversation and takes the pending messages as its new input. `WaitingInputs`
finds those conversations by a key of what such a request would send, without reading any other.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

from ksi_common import items
from ksi_common.errors import ErrorCode, KsiError
from ksi_common.ids import new_id
from ksi_daemon.services.conversations.response_lines import VERSION, message_line
from ksi_daemon.storage.models import ConversationMeta, PendingInput

MAX_PENDING = 1000  # messages one conversation may hold without a reply
# a conversation waiting with pending input, announced to the other daemons of a pool (through the
# relay, never emitted on a bus): {"conversation_id", "key"}
WAITING_RELAYED = "pool:conversation_waiting"  # not a bus event: no router knows it


def pending_of(meta: ConversationMeta) -> list[PendingInput]:
    return meta.pending_input or []


def _entry(waiting: str | items.Item, now: str) -> PendingInput:
    """A pending entry: a user message's text, or a call's output item (with its text beside it,
    so every reader of `content` shows something)."""
    if isinstance(waiting, str):
        return PendingInput(id=new_id("pend-"), content=waiting, ts=now)
    return PendingInput(id=new_id("pend-"), content=items.item_text(waiting), item=dict(waiting), ts=now)


def pended(meta: ConversationMeta, texts: list[str | items.Item], now: str, field: str
           ) -> tuple[list[PendingInput], list[PendingInput]]:
    """`meta`'s pending input with `texts` (user messages' texts, or function_call_output items)
    added, and the entries added; refused, naming `field`, when it would hold more than
    `MAX_PENDING`. Checked before anything is written, so the event adding them writes all it was
    given or nothing."""
    pending = pending_of(meta)
    if len(pending) + len(texts) > MAX_PENDING:
        raise KsiError(ErrorCode.VALIDATION_ERROR,
                       f"conversation {meta.conversation_id} would hold more than {MAX_PENDING} messages "
                       "without a reply", fields={field: f"at most {MAX_PENDING} pending messages"},
                       pending=len(pending))
    added = [_entry(text, now) for text in texts]
    return [*pending, *added], added


def _canonical(inputs: list[items.Item]) -> list[items.Item]:
    return [c for c in map(items.canonical_item, inputs) if c is not None]


def waiting_key(after: str | None, inputs: list[items.Item]) -> str:
    """The key of new input `inputs` sent after the exchange whose chained digest is `after` (None:
    before the first), in the canonical form digests use (a system message is not part of it)."""
    body = ["pending", after or "", _canonical(inputs)]
    return hashlib.sha256(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)).hexdigest()


def pending_item(entry: PendingInput) -> items.Item:
    return dict(entry.item) if entry.item is not None else items.message("user", entry.content)


def pending_items(meta: ConversationMeta) -> list[items.Item]:
    return [pending_item(entry) for entry in pending_of(meta)]


def is_pending_input(meta: ConversationMeta, inputs: list[items.Item]) -> bool:
    """Whether `inputs` are the conversation's pending messages (canonically, in order)."""
    pending = pending_items(meta)
    return bool(pending) and _canonical(pending) == _canonical(inputs)


class WaitingInputs:
    """Conversations holding pending input, by `waiting_key` of their newest exchange's digest and
    that input: a request matching one is found with a dict lookup. Kept in memory, from the
    conversations loaded or written since the daemon started and those the pool's other daemons
    announced since (pending input written before is found only once its conversation is loaded
    again)."""

    def __init__(self) -> None:
        self._by_key: dict[str, set[str]] = {}
        self._key_of: dict[str, str] = {}

    def note(self, conversation_id: str, newest_digest: str | None, total: int, meta: ConversationMeta
             ) -> str | None:
        """The conversation as it is now: `total` exchanges, the newest of digest `newest_digest`
        (None when it has none known), and `meta`'s pending input; returns its key when it waits."""
        self.drop(conversation_id)
        pending = pending_items(meta)
        if not pending or (total and newest_digest is None):
            return None
        key = waiting_key(newest_digest, pending)
        self.heard(conversation_id, key)
        return key

    def heard(self, conversation_id: str, key: str) -> None:
        """A conversation another daemon of the pool says waits under `key`: a candidate only,
        checked against the conversation as stored when a request matches it."""
        self.drop(conversation_id)
        self._by_key.setdefault(key, set()).add(conversation_id)
        self._key_of[conversation_id] = key

    def key_of(self, conversation_id: str) -> str | None:
        return self._key_of.get(conversation_id)

    def drop(self, conversation_id: str) -> None:
        key = self._key_of.pop(conversation_id, None)
        if key is None:
            return
        held = self._by_key.get(key)
        if held is not None:
            held.discard(conversation_id)
            if not held:
                del self._by_key[key]

    def holding(self, key: str) -> list[str]:
        return sorted(self._by_key.get(key, ()))

    def __len__(self) -> int:
        return len(self._key_of)


def pending_taken(meta: ConversationMeta, inputs: list[items.Item]) -> tuple[str, ...]:
    """The ids of the conversation's pending messages when `inputs` are those messages (a request
    matched to the conversation by them takes them as its input), else none."""
    return tuple(entry.id for entry in pending_of(meta)) if is_pending_input(meta, inputs) else ()


def with_pending(meta: ConversationMeta, inputs: list[dict[str, Any]], takes_pending: tuple[str, ...] = ()
                 ) -> list[dict[str, Any]]:
    """A request's input lines with the conversation's pending messages before its own user input
    (after a system line it sets), each line naming the pending message it came from.

    `takes_pending`: the ids of the pending messages the request was matched by at its admission,
    which are its input. Its input is then its own, once: each line names the message it stands
    for while that message still waits (so exactly those are consumed with it), and none is added
    before it, neither those (another request may have consumed them meanwhile: they are not
    sent twice) nor messages pended after its admission (they wait for the next request)."""
    if takes_pending:
        waiting = {entry.id for entry in pending_of(meta)}
        own = [line for line in inputs if line.get("type") != "system"]
        if len(own) != len(takes_pending):
            return inputs
        taken = iter(takes_pending)
        lines = []
        for line in inputs:
            if line.get("type") != "system":
                pending_id = next(taken)
                if pending_id in waiting:
                    line = {**line, "pending_id": pending_id}
            lines.append(line)
        return lines
    pending = pending_of(meta)
    if not pending:
        return inputs
    at = next((i for i, line in enumerate(inputs) if line.get("type") != "system"), len(inputs))
    model = next((line for line in inputs if line.get("type") != "system"), inputs[0] if inputs else {})
    shared = {key: model[key] for key in ("request_id", "conversation_id", "agent_id") if key in model}
    lines = [message_line("user", entry.content, entry.ts, **shared, pending_id=entry.id)
             if entry.item is None else
             {"v": VERSION, **items.input_line_fields(pending_item(entry)), "ts": entry.ts, **shared,
              "pending_id": entry.id} for entry in pending]
    return [*inputs[:at], *lines, *inputs[at:]]


def without_consumed(meta: ConversationMeta, inputs: list[dict[str, Any]]) -> ConversationMeta:
    """`meta` without the pending messages `inputs` took (a copy; any added since are kept)."""
    return without_pending(meta, {line["pending_id"] for line in inputs if line.get("pending_id")})


def without_pending(meta: ConversationMeta, taken: set[str]) -> ConversationMeta:
    """`meta` without the pending messages of ids `taken` (a copy; the others are kept)."""
    if not taken or not any(entry.id in taken for entry in pending_of(meta)):
        return meta
    left = [entry for entry in pending_of(meta) if entry.id not in taken]
    return meta.model_copy(update={"pending_input": left or None})
