"""The one write path of conversations: creating, committing exchanges to, importing, moving,
discarding and deleting a conversation, its metadata and its summaries.

Every service writes a conversation through a `ConversationWriter`, never through the storage
ports: so the conflict handling of a conditional append (another writer took the next exchange
number, or changed the metadata since it was read) is here, once, for a completion's commit and
for a client's appended exchanges alike. Writers hold the conversation's lock while they call in;
reads the cache does not offer are answered here too, from the same store.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import structlog

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.reading import StoredReader
from ksi_common.records import IndexEntry
from ksi_common.summaries import Summary
from ksi_common.timefmt import format_ts
from ksi_daemon.services.cancellation import to_the_end
from ksi_daemon.services.conversations.digests import next_digest
from ksi_daemon.services.conversations.memory import ConversationCache, ConversationMemory, Exchange
from ksi_daemon.services.conversations.pending import pending_of, without_pending
from ksi_daemon.storage.models import ConversationMeta
from ksi_daemon.storage.ports import ExchangeConflict, SummaryStore

log = structlog.get_logger("ksi.conversation")

# (the metadata as it is now, the entries being appended) -> the metadata to store with the last one
MetaAfter = Callable[[ConversationMeta, list[IndexEntry]], ConversationMeta]


def _refuse_retired(memory: ConversationMemory) -> None:
    """A conversation deleted or moved while a writer waited for its lock is not written again."""
    if memory.retired:
        raise KsiError(ErrorCode.CONVERSATION_NOT_FOUND, f"conversation {memory.conversation_id} not found",
                       conversation_id=memory.conversation_id)


@dataclass(slots=True)
class NewExchange:
    """One exchange to append: its index entry (numbered and chained by the writer), its
    response-record lines and its items as the next model sees them."""

    entry: IndexEntry
    lines: list[dict[str, Any]]
    exchange: Exchange


class ConversationWriter:
    """Owns every write of a conversation: the cache's memory and the store change together."""

    def __init__(self, cache: ConversationCache, summaries: SummaryStore, *, clock: Callable[[], float],
                 default_ttl: float | None, max_fork_depth: int) -> None:
        self.cache = cache
        self._store = cache.store
        self._summaries = summaries
        self.clock = clock
        self.default_ttl = default_ttl
        self.max_fork_depth = max_fork_depth

    # -- reads the cache does not offer -----------------------------------------
    @property
    def reader(self) -> StoredReader:
        """The store's read side (transcripts, recovery), which the `ksi` commands read through too."""
        return self._store

    @property
    def shared(self) -> bool:
        """Whether another daemon may write the same conversations."""
        return self._store.shared

    async def stored(self, conversation_id: str) -> bool:
        return await self._store.exists(conversation_id)

    async def taken(self, conversation_id: str) -> bool:
        """Whether the id names a conversation, in memory or stored."""
        return self.cache.cached(conversation_id) is not None or await self._store.exists(conversation_id)

    async def head(self, conversation_id: str) -> int:
        return await self._store.head(conversation_id)

    async def load_meta(self, conversation_id: str) -> ConversationMeta | None:
        return await self._store.load_meta(conversation_id)

    async def forks_of(self, conversation_id: str) -> list[str]:
        return await self._store.forks_of(conversation_id)

    async def summaries(self, conversation_id: str) -> list[Summary]:
        return await self._summaries.read(conversation_id)

    # -- creation ---------------------------------------------------------------
    def new_meta(self, conversation_id: str, **fields: Any) -> ConversationMeta:
        """The metadata of a new conversation made now, with the default TTL (fields given as None are left out)."""
        now = format_ts(self.clock())
        return ConversationMeta(conversation_id=conversation_id, ttl=self.default_ttl, created=now,
                                last_activity=now, **{k: v for k, v in fields.items() if v is not None})

    async def create(self, meta: ConversationMeta, *, for_request: bool = False) -> ConversationMemory:
        """A new conversation (exclusive: raises `ConversationExists` when the id is taken);
        `for_request`: created for a request, durable with its first exchange."""
        await self._store.create(meta, durable_with_first_exchange=for_request)
        return self.cache.create(meta)

    async def import_conversation(self, meta: ConversationMeta,
                                  exchanges: list[tuple[IndexEntry, list[dict[str, Any]]]]) -> None:
        """A new conversation whole, from exchanges made elsewhere (exclusive, like `create`)."""
        await self._store.import_conversation(meta, exchanges)
        newest = exchanges[-1][0].digest if exchanges else None
        self.cache.note_waiting(meta.conversation_id, newest, len(exchanges), meta)

    # -- changes (the caller holds the conversation's lock) --------------------------
    async def save_meta(self, memory: ConversationMemory, meta: ConversationMeta) -> None:
        _refuse_retired(memory)
        await self._store.save_meta(meta)
        memory.meta = meta
        self.cache.noted(memory)

    async def commit(self, memory: ConversationMemory, new: list[NewExchange], system: str | None,
                     meta_after: MetaAfter, *, answers: Collection[str] = ()) -> ConversationMeta:
        """Append `new` after the conversation's head in the durability order (each response
        record, then its index line); the metadata `meta_after` makes is stored with the last one.
        `answers`: the pending input the first exchange replies to, removed from the metadata
        stored with that first exchange (and every one after it), so exchanges written before a
        failure never leave answered input waiting.

        An append is conditional: when another writer took the next number first (or changed the
        metadata), the conversation is reloaded and the exchanges not yet written are numbered
        and chained after the new head; while none is written yet, `answers` must all still be
        waiting in the reloaded metadata (else history_mismatch: another writer answered them,
        and they are not answered twice). The metadata is made before the first write, so a
        `meta_after` that refuses writes nothing. The whole write (digests, reloads, every
        exchange) runs to its end once begun, cancels absorbed: an index line stored but not in
        memory would be given its number again; a store failing part-way leaves the exchanges
        before it written. A retired conversation (deleted or moved while this waited for its
        lock) is not written: conversation_not_found."""
        return await to_the_end(self._commit(memory, new, system, meta_after, set(answers)))

    async def _commit(self, memory: ConversationMemory, new: list[NewExchange], system: str | None,
                      meta_after: MetaAfter, answers: set[str]) -> ConversationMeta:
        _refuse_retired(memory)
        left = list(new)
        entries = [x.entry for x in new]
        # computed before anything is written: a meta_after that raises leaves nothing half-written
        final = without_pending(meta_after(memory.meta, entries), answers)
        while True:
            try:
                while left:
                    appending = left[0]
                    entry = appending.entry
                    entry.n = memory.next_n
                    entry.digest = await next_digest(self.cache, memory, system, appending.lines,
                                                     self.max_fork_depth)
                    if len(left) == 1:
                        meta: ConversationMeta | None = final
                    elif len(left) == len(new) and answers:
                        meta = without_pending(memory.meta, answers)
                    else:
                        meta = None
                    await self._store.append_exchange(memory.conversation_id, entry, response=appending.lines,
                                                      meta=meta)
                    if meta is not None:
                        memory.meta = meta
                    memory.append(entry, appending.exchange)
                    left.pop(0)
            except ExchangeConflict:
                await self.cache.reload(memory)
                _refuse_retired(memory)
                if len(left) == len(new):  # nothing of ours written yet: check again what it rests on
                    gone = answers - {entry.id for entry in pending_of(memory.meta)}
                    if gone:
                        raise KsiError(ErrorCode.HISTORY_MISMATCH,
                                       f"conversation {memory.conversation_id}: the pending input replied to "
                                       "was answered by another writer meanwhile",
                                       conversation_id=memory.conversation_id, pending_ids=sorted(gone)) from None
                final = without_pending(meta_after(memory.meta, entries), answers)
                continue
            self.cache.noted(memory)
            return memory.meta

    async def add_summary(self, summary: Summary) -> None:
        """A compaction summary (the caller then saves the metadata that counts it)."""
        await self._summaries.append(summary)

    # -- removal and moves ------------------------------------------------------------
    async def discard_unused(self, memory: ConversationMemory, unused: Callable[[], bool]) -> bool:
        """Remove a conversation made for a request that stored nothing there, while `unused()`
        still says so right before the delete; True when it went. Retired meanwhile, no request
        is admitted to it; kept (empty, listed) when the store refuses or fails."""
        async with memory.lock:
            if memory.retired or not unused():
                return False
            memory.retired = True
            discarded = False
            try:
                discarded = await self._store.discard_unused(memory.conversation_id)
            except Exception:
                log.exception("discard_failed", conversation_id=memory.conversation_id)
            finally:
                memory.retired = discarded
        if discarded:
            self.cache.forget(memory.conversation_id)
        return discarded

    async def delete(self, memory: ConversationMemory) -> list[str]:
        """Delete the conversation (under its lock, which the caller takes): its memory is retired,
        so a background writer holding it writes nothing more. Returns what was removed."""
        removed = await self._store.delete(memory.conversation_id)
        memory.retired = True
        self.cache.waiting.drop(memory.conversation_id)
        return removed

    async def delete_stored(self, conversation_id: str) -> list[str]:
        """Delete a conversation that is not in memory (a stray copy found at start)."""
        return await self._store.delete(conversation_id)

    async def move(self, conversation_id: str, new_id: str, note: dict[str, Any],
                   memory: ConversationMemory | None) -> list[str]:
        """Move the whole conversation to `new_id` (its forks follow; `note` goes in its metadata);
        its memory, if any, is retired and forgotten, as are its forks'. Returns the forks moved."""
        forks = await self._store.move(conversation_id, new_id, note)
        if memory is not None:
            memory.retired = True
        self.forget(conversation_id, *forks)
        return forks

    async def adopt(self, memory: ConversationMemory, source: ConversationMemory, meta: ConversationMeta) -> bool:
        """The exchanges of `source` become those of `memory`, in place of the ones it holds
        (which `source` begins with), `meta` its metadata; the source is removed. Both memories
        are forgotten (reloaded when next asked); the callers hold both locks. False, and nothing
        changed, when `memory`'s stored exchanges are not the ones it holds."""
        adopted = await self._store.adopt(memory.conversation_id, source.conversation_id, meta, memory.total)
        if adopted:
            source.retired = True
            self.forget(memory.conversation_id, source.conversation_id)
        return adopted

    def forget(self, *conversation_ids: str) -> None:
        for conversation_id in conversation_ids:
            self.cache.forget(conversation_id)
