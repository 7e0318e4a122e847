"""The chained digests of a conversation's stored exchanges: read along its fork chain, and the
next one computed when an exchange is written (a fork continues its parent's chain at its fork
point, since it shares those exchanges). A fork records the digest of its fork point when it is made,
so its first commit continues the chain without reading its parent's index."""

from __future__ import annotations

from typing import Any

from ksi_common import items
from ksi_daemon.services.conversations.history import fork_chain
from ksi_daemon.services.conversations.memory import ConversationCache, ConversationMemory


async def digest_at(cache: ConversationCache, memory: ConversationMemory, n: int, max_depth: int) -> str | None:
    """The digest of exchange `n` as this conversation sees it (its own, or an ancestor's it
    shares); None when that exchange has none (stored before digests) or does not exist."""
    if n > memory.base:
        return await _entry_digest(cache, memory, n)
    if n == memory.base and memory.meta.fork_digest is not None:
        return memory.meta.fork_digest
    for member, upto in (await fork_chain(cache, memory, max_depth))[1:]:
        if n > member.base and (upto is None or n <= upto):
            return await _entry_digest(cache, member, n)
    return None


async def fork_point_digest(cache: ConversationCache, parent: ConversationMemory, at: int, max_depth: int,
                            known: str | None = None) -> str | None:
    """What a fork of `parent` made at exchange `at` records of its fork point: its digest (None:
    none known, or no fork point at 0). `known`
    (the digest a caller matched there) is taken when the store names exchange `at` of `parent`
    for it, which reads no index; else it is read as `digest_at` reads it."""
    if at == 0:
        return None
    digest = None
    if known is not None and at > parent.base:
        held = await cache.find_digest(known)
        digest = known if any(m.conversation_id == parent.conversation_id and m.n == at for m in held) else None
    if digest is None:
        digest = await digest_at(cache, parent, at, max_depth)
    return digest


async def _entry_digest(cache: ConversationCache, memory: ConversationMemory, n: int) -> str | None:
    entry = memory.entry(n)
    if entry is None and n <= memory.total:  # older than the loaded tail
        await cache.load_all(memory)
        entry = memory.entry(n)
    return entry.digest if entry is not None else None


async def next_digest(cache: ConversationCache, memory: ConversationMemory, system: str | None,
                      lines: list[dict[str, Any]], max_depth: int) -> str | None:
    """The digest of the exchange about to be appended as `memory.next_n`, from its response-record
    lines and the system prompt in effect for it; None when the chain is broken before it."""
    n = memory.next_n
    previous = await digest_at(cache, memory, n - 1, max_depth) if n > 1 else None
    if n > 1 and previous is None:
        return None
    inputs = items.input_items([line for line in lines if line.get("type") != "assistant"])
    outcome = next((line for line in lines if line.get("type") == "assistant"), None)
    return items.exchange_digest(previous, system, inputs, items.output_items(outcome))


def record_chain(system: str | None, exchanges: list[list[dict[str, Any]]], previous: str | None = None
                 ) -> list[str]:
    """The digests of exchanges given as response-record lines, written one after another from
    `previous` (an import, an append); a system line among an exchange's inputs takes effect there."""
    chain = []
    for lines in exchanges:
        system = next((str(line.get("content")) for line in lines if line.get("type") == "system"), system)
        inputs = items.input_items([line for line in lines if line.get("type") != "assistant"])
        outcome = next((line for line in lines if line.get("type") == "assistant"), None)
        previous = items.exchange_digest(previous, system, inputs, items.output_items(outcome))
        chain.append(previous)
    return chain
