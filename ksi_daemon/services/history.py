"""Rebuilding the messages a stateless model is sent: system, history within budget, new input."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ksi_common.errors import ErrorCode, KsiError
from ksi_daemon.services.memory import ConversationCache, ConversationMemory, Exchange

NOTE_RESERVE = 48  # tokens kept free for the omitted-history note
MESSAGE_OVERHEAD = 4  # tokens a chat message costs beyond its text


@dataclass(slots=True)
class History:
    exchanges: list[Exchange] = field(default_factory=list)  # oldest first
    total: int = 0  # history-eligible exchanges in the conversation (fork chain included)
    tokens: int = 0

    @property
    def omitted(self) -> int:
        return max(0, self.total - len(self.exchanges))

    def stats(self) -> dict[str, int]:
        return {"exchanges_total": self.total, "exchanges_sent": len(self.exchanges), "tokens_sent": self.tokens}


async def fork_chain(
    cache: ConversationCache, memory: ConversationMemory, max_depth: int
) -> list[tuple[ConversationMemory, int | None]]:
    """The conversation and its ancestors, each with the last exchange it contributes."""
    chain: list[tuple[ConversationMemory, int | None]] = [(memory, None)]
    seen = {memory.conversation_id}
    current = memory
    while current.meta.parent_id:
        parent_id, upto = current.meta.parent_id, current.meta.fork_at
        if parent_id in seen or len(chain) > max_depth:
            raise KsiError(ErrorCode.FORK_CYCLE, "the fork chain loops or is too deep",
                           conversation_id=memory.conversation_id, at=parent_id)
        seen.add(parent_id)
        parent = await cache.get(parent_id)
        if parent is None:
            break  # a deleted parent: the fork keeps only its own exchanges
        await cache.load_all(parent)
        chain.append((parent, upto))
        current = parent
    return chain


async def select_history(
    cache: ConversationCache, memory: ConversationMemory, budget: int, max_depth: int
) -> History:
    """Whole exchanges, newest first across the fork chain, within `budget` tokens."""
    history = History()
    picked: list[tuple[ConversationMemory, list[Any]]] = []
    remaining = budget
    exhausted = False
    for member, upto in await fork_chain(cache, memory, max_depth):
        eligible = member.count_eligible(upto)
        if not member.complete:
            eligible += member.unloaded  # older exchanges not loaded still count
        history.total += eligible
        if exhausted:
            continue
        entries, used, whole = member.pick(remaining, upto)
        picked.append((member, entries))
        remaining -= used
        history.tokens += used
        if not whole or not member.complete:
            exhausted = True
    for member, entries in reversed(picked):
        history.exchanges.extend(await cache.texts(member, entries))
    return history


def omitted_note(count: int) -> str:
    noun = "exchange was" if count == 1 else "exchanges were"
    return f"[Note: {count} earlier {noun} left out of this conversation's history to fit the context window.]"


def build_messages(system: str | None, history: History, new_input: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """System (with the omitted note) + history as user/assistant turns + the new input."""
    messages: list[dict[str, Any]] = []
    system_text = system or ""
    if history.omitted:
        system_text = f"{system_text}\n\n{omitted_note(history.omitted)}" if system_text else omitted_note(history.omitted)
    if system_text:
        messages.append({"role": "system", "content": system_text})
    for exchange in history.exchanges:
        messages.extend(exchange.chat_messages())
    messages.extend(new_input)
    return messages
