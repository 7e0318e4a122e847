"""Finding a response within its conversation: which conversation indexed it, and at which exchange."""

from __future__ import annotations

from dataclasses import dataclass

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.ids import is_safe_id
from ksi_common.records import ResponseRecord
from ksi_daemon.services.conversations.memory import ConversationCache, ConversationMemory
from ksi_daemon.storage.ports import ResponseStore

MAX_HOPS = 256


@dataclass(slots=True)
class Located:
    record: ResponseRecord
    memory: ConversationMemory | None  # None: the response is in no conversation's history (it failed)
    n: int | None

    @property
    def conversation_id(self) -> str | None:
        return self.memory.conversation_id if self.memory is not None else None

    @property
    def newest(self) -> bool:
        return self.memory is not None and self.n == self.memory.total


async def read_response(responses: ResponseStore, response_id: str, code: ErrorCode) -> ResponseRecord:
    """The response file, or `code` (e.g. response_not_found) when there is none."""
    record = await responses.read(response_id) if is_safe_id(response_id) else None
    if record is None:
        raise KsiError(code, f"no response {response_id}", response_id=response_id)
    return record


async def locate(cache: ConversationCache, responses: ResponseStore, response_id: str,
                 code: ErrorCode = ErrorCode.RESPONSE_NOT_FOUND) -> Located:
    """The response and its exchange number in the conversation whose index lists it.

    The newest exchanges are in memory, so continuing the latest response costs no index read;
    an older one loads the whole index once (as a fork of that conversation would)."""
    record = await read_response(responses, response_id, code)
    conversation_id = next((line.get("conversation_id") for line in (record.outcome, *record.inputs)
                            if line and isinstance(line.get("conversation_id"), str)), None)
    if not record.ok or conversation_id is None:
        return Located(record, None, None)
    memory = await cache.get(conversation_id)
    if memory is None:
        return Located(record, None, None)  # its conversation was deleted
    n = _find(memory, response_id)
    if n is None and not memory.complete:
        await cache.load_all(memory)
        n = _find(memory, response_id)
    return Located(record, memory if n is not None else None, n)


def _find(memory: ConversationMemory, response_id: str) -> int | None:
    for entry in reversed(memory.entries):
        if entry.response_id == response_id:
            return entry.n
    return None


async def previous_of(cache: ConversationCache, found: Located) -> str | None:
    """The response of the exchange before this one in its conversation (a fork's first own exchange
    follows the parent's exchange it forked at); None for a first exchange or one in no history."""
    memory, n = found.memory, found.n
    for _hop in range(MAX_HOPS):  # bounded: a fork chain that loops must not hang a lookup
        if memory is None or n is None or n <= 1:
            return None
        if n - 1 > memory.base:
            if not memory.complete:
                await cache.load_all(memory)
            return next((e.response_id for e in memory.entries if e.n == n - 1), None)
        parent_id = memory.meta.parent_id
        memory = await cache.get(parent_id) if parent_id else None  # a deleted parent: unknown
    return None
