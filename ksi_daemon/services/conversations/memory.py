"""Conversations held in memory: metadata, index entries and exchange texts, loaded lazily.

A conversation is loaded from the tail of its index, only as far back as a token budget needs,
so the cost of a cold start follows the budget and not the length of the conversation.
"""

from __future__ import annotations

import asyncio
import bisect
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.items import Item, call_ids_answered, input_items, item_text, output_items, output_text
from ksi_common.records import IndexEntry, ResponseRecord
from ksi_common.summaries import Summary
from ksi_daemon.providers.tool_calls import input_messages, output_message
from ksi_daemon.services.conversations.pending import WaitingInputs
from ksi_daemon.services.conversations.salient import Items
from ksi_daemon.services.conversations.stand_ins import TurnSaw
from ksi_daemon.storage.models import ConversationMeta
from ksi_daemon.storage.ports import ConversationStore, DigestMatch, ResponseStore, StoredTail


@dataclass(slots=True)
class Exchange:
    """One exchange as the next model will see it: its input items (no system prompt, a message
    from an agent marked `[from AGENT]`) and its output items."""

    input: list[Item]
    output: list[Item]
    files: list[dict[str, Any]] = field(default_factory=list)
    # its chat messages, made once: a conversation in memory is sent again every turn
    _chat: list[dict[str, Any]] | None = field(default=None, repr=False, compare=False)
    # what a summary of it must keep (salience.exchange_salience), found once: a turn between two
    # summaries represents every exchange of the gap again; a re-read exchange is a new object
    salient: Items | None = field(default=None, repr=False, compare=False)

    @property
    def reply(self) -> str:
        return output_text(self.output)

    @property
    def answers_calls(self) -> bool:
        """Its input holds outputs of calls the exchange before it made: the two go together."""
        return bool(call_ids_answered(self.input))

    def sent_as(self, messages: list[dict[str, Any]]) -> Exchange:
        """This exchange sent as `messages` (its stored images rebuilt as image parts, say)."""
        return Exchange(self.input, self.output, self.files, messages)

    def chat_messages(self) -> list[dict[str, Any]]:
        if not self.input:  # its response file is missing or unreadable: a lone reply would break
            return []  # the user/assistant alternation (and some providers refuse it)
        if self._chat is None:
            self._chat = [*input_messages(self.input), output_message(self.output)]
        return self._chat


def exchange_input(lines: list[dict[str, Any]]) -> list[Item]:
    """A record's input lines as the items the model sees (the system prompt lives in the
    conversation's metadata; a message from an agent is marked as such)."""
    items: list[Item] = []
    for line in lines:
        if line.get("type") == "system":
            continue
        for item in input_items([line]):
            if line.get("from_agent") and isinstance(item.get("content"), str):
                item = {**item, "content": f"[from {line['from_agent']}] {item['content']}"}
            items.append(item)
    return items


def exchange_from_response(record: ResponseRecord) -> Exchange:
    files: list[dict[str, Any]] = []
    for line in record.inputs:
        files.extend(line.get("files") or [])
    return Exchange(input=exchange_input(record.inputs), output=output_items(record.outcome), files=files)


def items_tokens(items: list[Item], count_tokens: Callable[[str], int], overhead: int) -> int:
    """Tokens of items as the daemon counts them: each one's text and a message's overhead (an
    image part counts by its provider's rule, which the caller adds: not its label here)."""
    return sum(count_tokens(_counted_text(item)) + overhead for item in items)


def _counted_text(item: Item) -> str:
    content = item.get("content")
    if item.get("type") == "message" and isinstance(content, list):
        return " ".join(str(part.get("text") or "") for part in content
                        if isinstance(part, dict) and part.get("type") == "input_text")
    return item_text(item)


class ConversationMemory:
    """One conversation: its metadata, the loaded tail of its index, and exchange texts."""

    def __init__(self, meta: ConversationMeta) -> None:
        self.meta = meta
        self.total = 0  # number of exchanges in the index
        self.first_loaded = 1  # entries before this number are not in memory
        self.entries: list[IndexEntry] = []  # entries first_loaded..total, in order
        self.texts: dict[int, Exchange] = {}
        # the index tail has been read for this many tokens of history: a budget up to it is
        # served from memory (exchanges appended since are in memory too), never re-read
        self.tail_budget = 0
        # history-eligible (non-feedback) entries and a running sum of their tokens
        self._eligible: list[IndexEntry] = []
        self._eligible_n: list[int] = []
        self._sums: list[int] = [0]
        self.lock = asyncio.Lock()
        self.users = 0  # requests queued or running on it: it is not evicted meanwhile
        # summaries standing in for left-out exchanges, oldest first; None until first needed
        self.summaries: list[Summary] | None = None
        # a fork's: the record of the turn after its fork point it was read from, and the stored
        # summaries that turn had to choose from (conversations.inherited)
        self.inherited: tuple[str, TurnSaw | None] | None = None
        # deleted, or moved away by a reset: a background writer holding it writes nothing more
        self.retired = False

    @property
    def in_use(self) -> bool:
        return self.users > 0 or self.lock.locked()

    @property
    def conversation_id(self) -> str:
        return self.meta.conversation_id

    @property
    def base(self) -> int:
        """Exchanges shared with the parent: a fork's own exchanges are numbered after them."""
        return (self.meta.fork_at or 0) if self.meta.parent_id else 0

    @property
    def next_n(self) -> int:
        return max(self.total, self.base) + 1

    @property
    def stored_head(self) -> int:
        """The head its store holds while this memory is current: a fork with no exchange of its
        own has none stored (0), those it shares are its parent's."""
        return self.total if self.total > self.base else 0

    @property
    def complete(self) -> bool:
        return self.first_loaded <= self.base + 1

    @property
    def newest_digest(self) -> str | None:
        """The chained digest of the newest exchange when its entry is loaded (None: none known)."""
        entry = self.entry(self.total) if self.total else None
        return entry.digest if entry is not None else None

    def set_entries(self, entries: list[IndexEntry], total: int) -> None:
        self.total = max(total, self.base)
        self.entries = list(entries)
        self.first_loaded = entries[0].n if entries else self.total + 1
        self._eligible, self._eligible_n, self._sums = [], [], [0]
        for entry in entries:
            self._index_eligible(entry)

    def _index_eligible(self, entry: IndexEntry) -> None:
        if entry.is_feedback:
            return
        self._eligible.append(entry)
        self._eligible_n.append(entry.n)
        self._sums.append(self._sums[-1] + entry.tokens_in + entry.tokens_out)

    def entry(self, n: int) -> IndexEntry | None:
        """The loaded index entry numbered `n`, found by bisection (entries are in order)."""
        at = bisect.bisect_left(self.entries, n, key=lambda e: e.n)
        return self.entries[at] if at < len(self.entries) and self.entries[at].n == n else None

    def append(self, entry: IndexEntry, exchange: Exchange) -> None:
        self.entries.append(entry)
        self.total = entry.n
        self.texts[entry.n] = exchange
        self._index_eligible(entry)

    def eligible_tokens(self) -> int:
        return self._sums[-1]

    def pick(self, budget: int, upto: int | None = None, after: int = 0) -> tuple[list[IndexEntry], int, bool]:
        """Newest eligible entries (after < n <= upto) that fit `budget`, oldest first.

        Returns the entries, the tokens they use, and whether every loaded entry in that range
        fitted (so older history, if any, may still be wanted).
        """
        end = len(self._eligible) if upto is None else bisect.bisect_right(self._eligible_n, upto)
        low = bisect.bisect_right(self._eligible_n, after, 0, end) if after else 0
        floor = self._sums[end] - budget
        start = max(low, bisect.bisect_left(self._sums, floor, 0, end + 1)) if floor > 0 else low
        return self._eligible[start:end], self._sums[end] - self._sums[start], start == low

    def count_eligible(self, upto: int | None = None, after: int = 0) -> int:
        """Eligible exchanges after < n <= upto among the loaded ones."""
        end = len(self._eligible) if upto is None else bisect.bisect_right(self._eligible_n, upto)
        return end - (bisect.bisect_right(self._eligible_n, after, 0, end) if after else 0)

    def eligible_between(self, after: int, upto: int) -> list[IndexEntry]:
        """The loaded eligible entries with after < n <= upto, oldest first."""
        low = bisect.bisect_right(self._eligible_n, after)
        return self._eligible[low:bisect.bisect_right(self._eligible_n, upto)]

    def unloaded_after(self, after: int) -> int:
        """Exchanges numbered after `after` that exist but are not loaded."""
        return max(0, self.first_loaded - 1 - max(self.base, after))


NEWEST_TAIL_BUDGET = 4096  # tokens of index tail read first to find a conversation's newest exchange
LEGACY_MESSAGE_OVERHEAD = 4  # as history.MESSAGE_OVERHEAD, for exchanges counted here


def estimate_tokens(text: str) -> int:
    return (len(text) + 3) // 4


class ConversationCache:
    """A bounded LRU of conversations in memory, loaded through the conversation store.

    When the store is shared with other daemons, every `get` asks the store whether the head
    moved (a cheap query) and, in the same answer, gets a conversation whose history moved
    elsewhere as stored now, so a turn never sees stale history.
    """

    def __init__(self, store: ConversationStore, responses: ResponseStore, capacity: int,
                 count_tokens: Callable[[str], int] = estimate_tokens,
                 announce: Callable[[str, str], None] = lambda _conversation_id, _key: None) -> None:
        self.store = store
        self.responses = responses
        self.capacity = capacity
        self.count_tokens = count_tokens
        self.announce = announce  # tells the pool's other daemons a conversation waits under a new key
        self._items: OrderedDict[str, ConversationMemory] = OrderedDict()
        # conversations with pending input, by what a request taking it would send (see pending.py)
        self.waiting = WaitingInputs()

    def __len__(self) -> int:
        return len(self._items)

    def cached(self, conversation_id: str) -> ConversationMemory | None:
        return self._items.get(conversation_id)

    def held(self) -> list[ConversationMemory]:
        """The conversations in memory, the most recently used first."""
        return list(reversed(self._items.values()))

    def _keep(self, memory: ConversationMemory) -> ConversationMemory:
        self._items[memory.conversation_id] = memory
        self._items.move_to_end(memory.conversation_id)
        while len(self._items) > self.capacity:
            # a conversation with requests queued or running (or a commit under way) stays: a
            # second copy loaded beside it would miss the exchanges they write into the first
            victim = next((cid for cid, held in self._items.items() if not held.in_use), None)
            if victim is None:
                break
            del self._items[victim]
        return memory

    async def get(self, conversation_id: str, budget: int = 0) -> ConversationMemory | None:
        """The conversation, with at least `budget` tokens of history loaded when it has them."""
        memory = self._items.get(conversation_id)
        if memory is None:
            meta = await self.store.load_meta(conversation_id)
            if meta is None:
                return None
            memory = self._items.get(conversation_id)  # another task may have loaded it meanwhile
            if memory is None:
                memory = ConversationMemory(meta)
                entries, total = await self._read_tail(conversation_id, budget)
                memory.set_entries(entries, total)
                memory.tail_budget = budget
                self.noted(memory)
        else:
            self._items.move_to_end(conversation_id)
            if self.store.shared:
                stored = await self.store.moved_since(conversation_id, memory.stored_head, budget)
                if stored is not None:
                    if self._items.get(conversation_id) is memory:
                        del self._items[conversation_id]
                    if stored.meta is None:
                        return None
                    # a new memory: requests holding the stale one (and its lock) finish on it
                    memory = self._items.get(conversation_id) or await self._loaded(stored, budget)
        await self.widen(memory, budget)
        return self._keep(memory)

    async def _loaded(self, stored: StoredTail, budget: int) -> ConversationMemory:
        assert stored.meta is not None
        memory = ConversationMemory(stored.meta)
        memory.set_entries(await self._counted(stored.entries), stored.head)
        memory.tail_budget = budget
        return self.noted(memory)

    async def widen(self, memory: ConversationMemory, budget: int) -> ConversationMemory:
        """`memory` with at least `budget` tokens of history loaded when it has them, without asking
        a shared store again whether it moved (the caller's `get` just did)."""
        if budget > memory.tail_budget and not memory.complete and memory.eligible_tokens() < budget:
            await self._extend(memory, budget)
        return memory

    async def fresh(self, memory: ConversationMemory) -> bool:
        """Whether the store's head is still the one in memory; a stale memory is dropped."""
        if await self.store.head(memory.conversation_id) == memory.stored_head:
            return True
        if self._items.get(memory.conversation_id) is memory:
            del self._items[memory.conversation_id]
        return False

    async def reload(self, memory: ConversationMemory, budget: int = 0) -> ConversationMemory:
        """Load the conversation again from the store (after another writer moved its head);
        `memory` takes over the fresh state, so holders of it (and of its lock) see it."""
        meta = await self.store.load_meta(memory.conversation_id)
        if meta is None:
            raise KsiError(ErrorCode.CONVERSATION_NOT_FOUND, f"conversation {memory.conversation_id} does not exist",
                           conversation_id=memory.conversation_id)
        memory.meta = meta
        memory.texts.clear()
        memory.summaries = None  # read again too: another writer may have added one
        entries, total = await self._read_tail(memory.conversation_id, max(budget, memory.tail_budget))
        memory.set_entries(entries, total)
        memory.tail_budget = max(budget, memory.tail_budget)
        return self._keep(self.noted(memory))

    async def require(self, conversation_id: str, budget: int = 0) -> ConversationMemory:
        memory = await self.get(conversation_id, budget)
        if memory is None:
            raise KsiError(ErrorCode.CONVERSATION_NOT_FOUND, f"conversation {conversation_id} does not exist",
                           conversation_id=conversation_id)
        return memory

    async def _extend(self, memory: ConversationMemory, budget: int) -> None:
        entries, total = await self._read_tail(memory.conversation_id, budget)
        if total != memory.total:  # the index moved in storage under us: take all of it
            entries = await self._read_index(memory.conversation_id)
            total = entries[-1].n if entries else 0
        if entries and entries[0].n < memory.first_loaded:
            memory.set_entries(entries, total)
        memory.tail_budget = max(memory.tail_budget, budget)

    async def load_newest(self, memory: ConversationMemory) -> None:
        """At least the newest history exchange's index entry loaded, when the conversation has
        one: a cold conversation reads the tail of its index, a wider one each round, not all of it.
        A conversation with requests under way is left as their preparation loaded it."""
        budget = max(memory.tail_budget, NEWEST_TAIL_BUDGET)
        for _round in range(4):
            if memory.count_eligible() or memory.complete or memory.in_use:
                return
            await self._extend(memory, budget)
            budget *= 16
        if not memory.count_eligible() and not memory.in_use:
            await self.load_all(memory)

    async def load_all(self, memory: ConversationMemory) -> None:
        """Load every index entry (for forks of this conversation and inspection)."""
        if not memory.complete:
            entries = await self._read_index(memory.conversation_id)
            memory.set_entries(entries, entries[-1].n if entries else 0)

    # -- readers ----------------------------------------------------------------
    async def find_digest(self, digest: str) -> list[DigestMatch]:
        """The stored exchanges holding a chained digest (a client-held history is matched by it)."""
        return await self.store.find_digest(digest)

    async def _read_tail(self, conversation_id: str, budget: int) -> tuple[list[IndexEntry], int]:
        entries, total = await self.store.read_tail(conversation_id, budget)
        return await self._counted(entries), total

    async def _read_index(self, conversation_id: str) -> list[IndexEntry]:
        return await self._counted(await self.store.entries(conversation_id))

    async def _counted(self, entries: list[IndexEntry]) -> list[IndexEntry]:
        """Legacy bare-id index lines carry no token counts, so the budget would take their
        exchanges for free: count them from their response records once, when loaded."""
        uncounted = [e for e in entries if not (e.tokens_in or e.tokens_out or e.is_feedback)]
        if not uncounted:
            return entries
        records = await self.responses.read_many([e.response_id for e in uncounted])
        for entry, record in zip(uncounted, records, strict=True):
            if record is None:
                continue
            exchange = exchange_from_response(record)
            entry.tokens_in = items_tokens(exchange.input, self.count_tokens, LEGACY_MESSAGE_OVERHEAD)
            entry.tokens_out = items_tokens(exchange.output, self.count_tokens, LEGACY_MESSAGE_OVERHEAD)
        return entries

    async def texts(self, memory: ConversationMemory, entries: list[IndexEntry]) -> list[Exchange]:
        """The exchange texts of `entries`, reading only the response records not in memory."""
        missing = [e for e in entries if e.n not in memory.texts]
        if missing:
            records = await self.responses.read_many([e.response_id for e in missing])
            for entry, record in zip(missing, records, strict=True):
                memory.texts[entry.n] = (
                    exchange_from_response(record) if record is not None
                    else Exchange(input=[], output=[])
                )
        return [memory.texts[e.n] for e in entries]

    def create(self, meta: ConversationMeta) -> ConversationMemory:
        memory = ConversationMemory(meta)
        memory.set_entries([], 0)
        memory.summaries = []  # a new conversation has none (a reset or delete took the old id's along)
        return self._keep(self.noted(memory))

    def noted(self, memory: ConversationMemory) -> ConversationMemory:
        """`memory` as `waiting` should know it (its pending input, after its newest exchange)."""
        self.note_waiting(memory.conversation_id, memory.newest_digest, memory.total, memory.meta)
        return memory

    def note_waiting(self, conversation_id: str, newest_digest: str | None, total: int,
                     meta: ConversationMeta) -> None:
        """The conversation's pending input as `waiting` should know it (see WaitingInputs.note),
        announced to the pool's other daemons when it waits under a new key."""
        before = self.waiting.key_of(conversation_id)
        key = self.waiting.note(conversation_id, newest_digest, total, meta)
        if key is not None and key != before:
            self.announce(conversation_id, key)

    def forget(self, conversation_id: str) -> None:
        self._items.pop(conversation_id, None)
        self.waiting.drop(conversation_id)
