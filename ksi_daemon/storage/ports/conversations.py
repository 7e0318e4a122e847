"""The conversation store's port: metadata, the exchange index, and the conditional writes that
let several daemons share one backend (`ExchangeConflict`, `ConversationExists`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ksi_common.reading import StoredReader
from ksi_common.records import IndexEntry
from ksi_daemon.storage.models import ConversationMeta


class ExchangeConflict(Exception):
    """Exchange `n` is taken (another writer appended first): reload the head and retry."""

    def __init__(self, conversation_id: str, n: int, head: int) -> None:
        super().__init__(f"exchange {n} of {conversation_id} is taken; the head is {head}")
        self.conversation_id = conversation_id
        self.n = n
        self.head = head


@dataclass(frozen=True, slots=True)
class StoredTail:
    """A conversation as stored now: its metadata (None when it is gone), the newest entries
    within a token budget (oldest first) and its head."""

    meta: ConversationMeta | None
    entries: list[IndexEntry]
    head: int


@dataclass(frozen=True, slots=True)
class DigestMatch:
    """An exchange whose chained digest is the one looked up."""

    conversation_id: str
    n: int


class ConversationExists(Exception):
    """An exclusive create found the conversation already there."""

    def __init__(self, conversation_id: str) -> None:
        super().__init__(f"conversation {conversation_id} already exists")
        self.conversation_id = conversation_id


class ConversationStore(StoredReader, Protocol):
    """Conversations: metadata, the exchange index, and the lifecycle moves of both."""

    @property
    def shared(self) -> bool:
        """True when another daemon may write the same conversations (caches must check `head`)."""
        ...

    async def exists(self, conversation_id: str) -> bool:
        """Whether the conversation has metadata or an index."""
        ...

    async def create(self, meta: ConversationMeta, *, durable_with_first_exchange: bool = False) -> None:
        """Exclusive create: raises `ConversationExists` when the id is taken (metadata or index).

        `durable_with_first_exchange`: created for a request, so nothing is promised about it
        before that request's result; a backend that syncs its writes may make it durable
        together with the first exchange instead of on its own.
        """
        ...

    async def load_meta(self, conversation_id: str) -> ConversationMeta | None:
        """The metadata; an index without metadata gets a minimal record; None when neither exists."""
        ...

    async def save_meta(self, meta: ConversationMeta) -> None:
        """Replace the metadata of an existing conversation (last writer wins)."""
        ...

    async def head(self, conversation_id: str) -> int:
        """The number of the last indexed exchange (0 when none); cheap: no history is read."""
        ...

    async def moved_since(self, conversation_id: str, head: int, token_budget: int) -> StoredTail | None:
        """None while the stored head is still `head`; else the conversation as stored now, its
        tail within `token_budget` (as `read_tail`). A shared backend answers both in one round
        trip: a cache holding a conversation another daemon moved reloads it in that one."""
        ...

    async def append_exchange(self, conversation_id: str, entry: IndexEntry, *,
                              response: list[dict[str, Any]] | None = None,
                              meta: ConversationMeta | None = None) -> None:
        """Conditional append of one exchange, durable before it returns: first its response
        record (`response`, the record's lines, when given: kept as is if an earlier attempt of
        this append wrote it), then the index line of `entry`, then `meta` replaces the metadata.

        Refused with `ExchangeConflict` when an exchange numbered `entry.n` or later is already
        indexed: no index line and no metadata are written; the caller reloads the head and
        the metadata, renumbers, and calls again with the same response.
        """
        ...

    async def read_tail(self, conversation_id: str, token_budget: int) -> tuple[list[IndexEntry], int]:
        """The newest non-feedback entries whose token counts fit the budget (oldest first) and the
        head; the cost follows the budget, not the length of the conversation."""
        ...

    async def find_digest(self, digest: str) -> list[DigestMatch]:
        """Every stored exchange whose chained digest is `digest` (a fork's shared exchanges are its
        parent's); the cost does not follow the number of stored conversations."""
        ...

    async def move(self, conversation_id: str, new_id: str, note: dict[str, Any]) -> list[str]:
        """Move a whole conversation (index and metadata) to `new_id`, noting `note` in its
        metadata's `extra`; forks of it follow it. Returns the forks repointed. Response records
        are untouched (they are named by response id)."""
        ...

    async def adopt(self, conversation_id: str, source_id: str, meta: ConversationMeta, replaced: int = 0) -> bool:
        """The exchanges of `source_id` (index, summaries) become those of `conversation_id`,
        in place of the `replaced` exchanges it holds (the source holds copies of them); `meta`
        replaces its metadata, the source's response records name it from then on and the source
        is removed. False, and nothing changed, when `conversation_id` does not hold exactly
        `replaced` exchanges or the source is gone. The replaced exchanges' response records stay,
        indexed nowhere, until the conversation is deleted."""
        ...

    async def discard_unused(self, conversation_id: str) -> bool:
        """Remove a conversation that holds no exchange (made for a request that failed before
        any was stored), its response records left as they are; False, and nothing removed, when
        it holds one (another writer's, perhaps)."""
        ...

    async def delete(self, conversation_id: str) -> list[str]:
        """Delete the index, the metadata and the response records that belong to the
        conversation and to no other index. Returns what was removed, as names of the stored
        items (JSONL: paths relative to the var dir)."""
        ...

    async def import_conversation(self, meta: ConversationMeta,
                                  exchanges: list[tuple[IndexEntry, list[dict[str, Any]]]]) -> None:
        """Create a conversation whole from imported exchanges (entry, response-record lines):
        exclusive like `create`; its response records are new ones."""
        ...
