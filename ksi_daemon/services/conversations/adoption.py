"""A conversation that takes over the exchanges of a run's own conversation, when a client adds
that run's items to it after the run.

A session that keeps its history in a conversation S, but asks its responses without naming S
(sending S's items and the new message instead), gets a run answered in a new conversation A
when no stored history matched: S was empty, or its items were sent under another system prompt
(A then begins with a copy of them). After the run it adds the run's items to S. When A's
exchanges are exactly S's items then those, A was made for the same scope moments before, and
nothing has continued A since, the two are one conversation: S takes A's exchanges in place of
its own, A's response ids resolve into S, and A is removed. On OpenAI the same requests end in two stored
copies of the run (the responses' and the items added to S); KSI keeps one readable conversation.
"""

from __future__ import annotations

from collections.abc import Iterable

from ksi_common import items
from ksi_common.timefmt import parse_ts
from ksi_daemon.services.conversations.added_items import item_key
from ksi_daemon.services.conversations.memory import ConversationMemory, Exchange
from ksi_daemon.services.conversations.pending import pending_of
from ksi_daemon.services.conversations.scope import stored_scope
from ksi_daemon.storage.models import ConversationMeta

ADOPTION_WINDOW = 600.0  # seconds: how recently the run's conversation was made to be taken over
ADOPTED_FROM = "adopted_from"  # in the taking conversation's extra: the conversation it took over
# in the extra of a conversation a response made because it named none (never one a client made)
MADE_FOR_RUN = "made_for_run"


def may_take_over(memory: ConversationMemory) -> bool:
    """Whether `memory` (the conversation items are added to) could take a run's exchanges: it
    holds no pending input and is no fork."""
    return not pending_of(memory.meta) and memory.meta.parent_id is None


def candidates(memory: ConversationMemory, held: Iterable[ConversationMemory], now: float,
               count: int) -> list[ConversationMemory]:
    """The conversations in memory that could be the run's: made for the same scope within the
    window by a response that named no conversation, with the same system prompt (or `memory` has none), holding exactly `count` exchanges,
    none waiting, nothing running, no fork."""
    scope = stored_scope(memory.meta)
    found = []
    for other in held:
        meta = other.meta
        if (other is memory or other.retired or not meta.extra.get(MADE_FOR_RUN) or memory.meta.system not in (None, meta.system) or other.in_use or other.total != count or meta.parent_id
                or meta.status != "active" or pending_of(meta) or stored_scope(meta) != scope):
            continue
        if now - parse_ts(meta.created) > ADOPTION_WINDOW:
            continue
        found.append(other)
    return found


def exchange_items(exchanges: list[Exchange]) -> list[items.Item]:
    return [item for exchange in exchanges for item in (*exchange.input, *exchange.output)]


def repeats(exchanges: list[Exchange], held: list[items.Item], added: list[items.Item]) -> bool:
    """Whether the exchanges' items are exactly the items held then the items added, in order
    (compared as the items a conversation already holds are)."""
    return [item_key(item) for item in exchange_items(exchanges)] == [item_key(item) for item in (*held, *added)]


def adopted_meta(meta: ConversationMeta, source: ConversationMeta) -> ConversationMeta:
    """The taking conversation's metadata once it holds the source's exchanges: its own id, title,
    tags and scope; the source's system prompt (the exchanges' digests were chained with it),
    totals and pins."""
    return meta.model_copy(update={
        "system": source.system, "system_changes": source.system_changes, "exchanges": source.exchanges,
        "tokens_in": source.tokens_in, "tokens_out": source.tokens_out, "cost": source.cost,
        "models": source.models, "last_activity": source.last_activity, "cli_session": source.cli_session,
        "pins": source.pins, "compaction": source.compaction,
        "preview": meta.preview or source.preview,
        "extra": {**{k: v for k, v in source.extra.items() if k != MADE_FOR_RUN}, **meta.extra,
                  ADOPTED_FROM: source.conversation_id}})
