"""Continuity for stateless clients: a request carrying its own earlier turns (`history`) is
matched to the stored conversation whose chain of digests it extends.

The history is split into exchanges (the input items before each run of output items) and its
chain of digests computed as stored exchanges compute theirs. Then, before the request is
admitted:

- with `conversation_id` or `previous_response_id`, the history must be that conversation's (up to
  that response): else `history_mismatch` naming the first exchange that differs, nothing written;
- else the newest exchange of the history is looked up: found as a conversation's newest exchange,
  the request continues it; found as an older one, or only a shorter part of the history found, a
  copy-free fork is made there and the turns that differ are appended to it; nothing found, the
  history is imported as a new conversation. A match only in an archived, expired or full
  conversation imports the history as a new conversation whose metadata names it.

Several conversations holding the digest hold the same whole history (the chain covers every
exchange before): open ones first, then the one where it is the newest exchange, then the most
recently active. Only conversations stored for whom the request names are matched (see
conversations.scope); those it makes keep that scope.

A request without a conversation whose history and new input are a conversation's exchanges and
its pending input (a client that added its user item to a conversation, then asked with the whole
history and none named) continues that conversation, taking the pending messages as its new input;
with no history, a conversation with no exchanges whose pending input is the request's input, and
that only under the conversation's own system prompt (a stranger sending the same first words
must not run under it). Either only within `pending_match_window` seconds of the newest pending
input. Such conversations are found by `WaitingInputs` (see conversations.pending), not by
reading others.

A conversation is continued in place only while no turn of it is queued or running, on this
daemon or, on a pool, on any other (the pool's turn line knows): else the history forks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from ksi_common import items
from ksi_common.errors import ErrorCode, KsiError
from ksi_common.events import CONVERSATION_APPEND, CONVERSATION_FORK, CONVERSATION_IMPORT
from ksi_common.timefmt import parse_ts
from ksi_daemon.context import EventContext
from ksi_daemon.providers.tool_calls import input_messages, output_message
from ksi_daemon.router import Router
from ksi_daemon.services.completion.models import CompletionAsync
from ksi_daemon.services.completion.tool_turns import check_answers
from ksi_daemon.services.conversations.client_items import OUTPUT_KINDS, normalised
from ksi_daemon.services.conversations.digests import digest_at
from ksi_daemon.services.conversations.memory import ConversationCache, ConversationMemory
from ksi_daemon.services.conversations.pending import is_pending_input, pending_of, pending_taken, waiting_key
from ksi_daemon.services.conversations.responses import locate
from ksi_daemon.services.conversations.scope import Scope, request_scope, stored_scope
from ksi_daemon.storage.ports import ResponseStore

MESSAGE_OVERHEAD = 4  # as history.MESSAGE_OVERHEAD: tokens a chat message costs beyond its text


def _invalid(where: str, why: str) -> KsiError:
    return KsiError(ErrorCode.VALIDATION_ERROR, f"{where}: {why}", fields={where: why})


@dataclass(slots=True)
class ClientTurns:
    """A client-held history as exchanges (input items, output items), each under the system prompt
    in effect for it (`system` is the first one: the history's, as an import stores it)."""

    system: str | None
    exchanges: list[tuple[list[items.Item], list[items.Item]]] = field(default_factory=list)
    systems: list[str | None] = field(default_factory=list)  # the system prompt of each exchange

    def chain(self) -> list[str]:
        chain: list[str] = []
        previous = None
        for system, (inputs, outputs) in zip(self.systems, self.exchanges, strict=True):
            previous = items.exchange_digest(previous, system, inputs, outputs)
            chain.append(previous)
        return chain

    def text_only(self) -> bool:
        """Every item a message whose content is text (what `conversation:append` can store)."""
        return all(item.get("type", "message") == "message" and isinstance(item.get("content"), str)
                   for inputs, outputs in self.exchanges for item in (*inputs, *outputs))

    def has_images(self) -> bool:
        """Whether an input holds an image or a PDF (stored bytes a client's history only names)."""
        return any(items.media_parts(inputs) for inputs, _outputs in self.exchanges)

    def messages(self) -> list[dict[str, Any]]:
        """The history as chat messages: its tool calls and their outputs as the provider takes them."""
        return [message for inputs, outputs in self.exchanges
                for message in (*input_messages(inputs), output_message(outputs))]


def split_history(history: list[Any], instructions: str | None = None, name: str = "history") -> ClientTurns:
    """The client's earlier turns as exchanges. System messages opening the history are its system
    prompt; a later one replaces it from the exchange it stands in on (as a system message in a
    request's new input does); `instructions`, when given, is the system prompt of every exchange."""
    turns = ClientTurns(system=None)
    system_parts: list[str] = []
    later: str | None = None  # a system prompt given after the history began
    waiting: int | None = None  # where a later system message stands with no turn after it yet
    inputs: list[items.Item] = []
    outputs: list[items.Item] = []

    def close() -> None:
        opening = "\n\n".join(system_parts) or None
        turns.exchanges.append((inputs, outputs))
        turns.systems.append(instructions if instructions is not None else (later if later is not None else opening))

    for position, raw in enumerate(history):
        where = f"{name}.{position}"
        item = normalised(raw, where)
        kind, role = item["type"], item.get("role")
        if kind == "message" and role == "system":
            text = items.part_text(item["content"])
            if not turns.exchanges and not inputs and not outputs:
                system_parts.append(text)
                continue
            if outputs:  # between exchanges: it holds from the next one on
                close()
                inputs, outputs = [], []
            later, waiting = text, (position if not inputs else None)
            continue
        is_output = kind in OUTPUT_KINDS or (kind == "message" and role == "assistant")
        if is_output:
            if not inputs and not outputs:
                raise _invalid(f"{where}.role", "an assistant turn needs a user turn before it")
            outputs.append(item)
            continue
        if outputs:  # an input after outputs opens the next exchange
            close()
            inputs, outputs = [], []
        inputs.append(item)
        waiting = None
    if waiting is not None:
        raise _invalid(f"{name}.{waiting}.role", "a system message after the last exchange belongs to the new "
                                                  "input (messages or input), not to the history")
    if inputs and not outputs:
        raise _invalid(f"{name}.{len(history) - 1}", "the history must end with an assistant turn "
                                                      "(what is new goes in prompt, messages or input)")
    if outputs:
        close()
    turns.system = instructions if instructions is not None else ("\n\n".join(system_parts) or None)
    return turns


def admission_key(data: CompletionAsync) -> str:
    """What two requests that could continue the same conversation in place share: their
    history, new input and instructions, as sent (a key to admit them one at a time)."""
    body = [data.history or [], data.input_items(), data.instructions]
    return hashlib.sha256(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)).hexdigest()


def _check_follows(turns: ClientTurns, data: CompletionAsync) -> None:
    """The new input must answer exactly the calls the history's newest exchange made: checked
    before anything is written for the history (an import, a fork), not after it, once per retry."""
    if turns.exchanges:
        check_answers(items.call_ids_answered(data.input_items()), items.function_calls(turns.exchanges[-1][1]))


def _requested_system(data: CompletionAsync, default: str | None) -> str | None:
    """The system prompt a request's first exchange would run under, as far as the request says."""
    if data.instructions is not None:
        return data.instructions
    if data.system is not None:
        return data.system
    given = [items.part_text(item["content"]) for item in data.input_items()
             if item["type"] == "message" and item.get("role") == "system"]
    return "\n\n".join(given) if given else default


def _same_system(waiting: str | None, requested: str | None) -> bool:
    """Whether a conversation with no exchange yet, waiting under system prompt `waiting`, may be
    continued by a request under `requested`. With exchanges their digests compare the system
    prompt; before the first, the conversation's own is compared, canonically as digests do. One
    made without a system prompt (the Agents SDK's session, whose instructions come with each
    request) takes the request's."""
    if waiting is None:
        return True
    return requested is not None and items.canonical_text(waiting) == items.canonical_text(requested)


@dataclass(frozen=True, slots=True)
class Match:
    memory: ConversationMemory
    n: int


@dataclass(frozen=True, slots=True)
class Resolved:
    """A request naming the conversation it runs in; `takes_pending`: the ids of that conversation's
    pending messages it was matched by, which are the request's new input (and are not added
    before it again)."""

    data: CompletionAsync
    takes_pending: tuple[str, ...] = ()


class ClientHistory:
    """Resolves a request's client-held history to the conversation it continues."""

    def __init__(self, cache: ConversationCache, responses: ResponseStore, router: Router,
                 count_live: Callable[[str], int], is_open: Callable[[ConversationMemory], bool],
                 max_depth: int, pending_window: float, clock: Callable[[], float],
                 in_line: Callable[[str], Awaitable[int]]) -> None:
        self.cache = cache
        self.responses = responses
        self.router = router
        self.count_live = count_live  # requests queued or running on a conversation
        self.is_open = is_open  # active, not expired, not full
        self.max_depth = max_depth
        self.pending_window = pending_window  # seconds pending input is matched by a request naming no conversation
        self.clock = clock
        self.in_line = in_line  # turns accepted on a conversation and not ended, over every daemon of a pool

    def may_take_pending(self, data: CompletionAsync) -> bool:
        """Whether a request with no history, no conversation and no agent (which has a conversation
        of its own) names a conversation's pending input (one dict lookup)."""
        if (data.history or data.conversation_id or data.previous_response_id or data.agent_id
                or not len(self.cache.waiting)):  # no conversation waits: not even the key is computed
            return False
        return bool(self.cache.waiting.holding(waiting_key(None, data.input_items())))

    async def resolve(self, data: CompletionAsync, context: EventContext,
                      before_write: Callable[[CompletionAsync], Awaitable[None]],
                      default_system: str | None = None) -> Resolved:
        """`data` naming the conversation its history belongs to (made when needed); its history
        stays, for the provider to be sent when it fits. `before_write` refuses the request before
        a conversation is written for it; `default_system` is the system prompt of a history that
        names none (an agent's profile's)."""
        turns = split_history(data.history or [], data.instructions)
        _check_follows(turns, data)
        if turns.system is None and data.system is None and default_system is not None:
            turns.system = default_system
            turns.systems = [default_system if system is None else system for system in turns.systems]
        chain = turns.chain()
        scope = request_scope(data.agent_id, data.options)
        if data.conversation_id is None and data.previous_response_id is None:
            waiting = await self._waiting(chain[-1] if chain else None, len(chain), data, scope,
                                          _requested_system(data, default_system))
            if waiting is not None:
                return Resolved(data.model_copy(update={"conversation_id": waiting.conversation_id}),
                                pending_taken(waiting.meta, data.input_items()))
        if not turns.exchanges:
            return Resolved(data)
        if data.previous_response_id is not None:
            found = await locate(self.cache, self.responses, data.previous_response_id,
                                 ErrorCode.PREVIOUS_RESPONSE_NOT_FOUND)
            if found.memory is not None and found.n is not None:
                await self._check_same(found.memory, found.n, chain)
            return Resolved(data)  # continued after that response, as without a history
        if data.conversation_id is not None:
            memory = await self.cache.get(data.conversation_id)
            if memory is not None:
                await self._check_same(memory, memory.total, chain)
                return Resolved(data)
            if not data.create:
                return Resolved(data)  # conversation_not_found, as without a history
            await before_write(data)
            await self._import(turns, context, data, scope, new_id=data.conversation_id)
            return Resolved(data)
        newest = await self._best(await self._matches(chain[-1], len(chain), scope))
        if newest is not None and self.is_open(newest.memory):
            if newest.n == newest.memory.total and await self._free_at(newest):
                # its pending input may be this input (added before the daemon started, so not in
                # `waiting`): taken, not added again
                takes = pending_taken(newest.memory.meta, data.input_items())
                return Resolved(data.model_copy(update={"conversation_id": newest.memory.conversation_id}), takes)
            await before_write(data)
            fork = await self._fork(newest, chain[newest.n - 1], context, data)
            return Resolved(data.model_copy(update={"conversation_id": fork}))
        await before_write(data)
        if newest is not None:  # only in a conversation that cannot continue
            imported = await self._import(turns, context, data, scope, linked=newest)
            return Resolved(data.model_copy(update={"conversation_id": imported}))
        shared = await self._longest_prefix(chain, scope)
        if shared is None or not self.is_open(shared.memory) or not turns.text_only():
            imported = await self._import(turns, context, data, scope, linked=shared)
            return Resolved(data.model_copy(update={"conversation_id": imported}))
        fork = await self._fork(shared, chain[shared.n - 1], context, data)
        await self._append(fork, turns.exchanges[shared.n:], context)
        return Resolved(data.model_copy(update={"conversation_id": fork}))

    # -- matching ------------------------------------------------------------------
    async def _matches(self, digest: str, n: int, scope: Scope) -> list[Match]:
        """The stored exchanges numbered `n` holding `digest` in conversations stored for `scope`,
        each checked against the digest its own conversation stored for that exchange (the JSONL
        lookup is derived data, and a damaged log may name any conversation): read from the
        loaded tail when it holds the exchange, else from the conversation's index."""
        found = []
        for candidate in await self.cache.find_digest(digest):
            if candidate.n != n:
                continue
            memory = await self.cache.get(candidate.conversation_id)
            if memory is None or memory.retired or candidate.n > memory.total or stored_scope(memory.meta) != scope:
                continue
            entry = memory.entry(candidate.n)
            stored = entry.digest if entry is not None else await digest_at(self.cache, memory, n, self.max_depth)
            if stored != digest:
                continue
            found.append(Match(memory, candidate.n))
        return found

    async def _waiting(self, after: str | None, n: int, data: CompletionAsync, scope: Scope,
                       system: str | None) -> ConversationMemory | None:
        """The conversation of `scope` whose `n` exchanges end in digest `after` and whose pending
        input is the request's new input, added within the window and waiting under the request's
        system prompt `system`, free to continue in place; the most recently active of several.
        Each candidate is checked as loaded (the map is derived from what was written)."""
        inputs = data.input_items()
        found = []
        for conversation_id in self.cache.waiting.holding(waiting_key(after, inputs)):
            memory = await self.cache.get(conversation_id)
            if (memory is None or memory.retired or memory.total != n or memory.newest_digest != after
                    or stored_scope(memory.meta) != scope or not self.is_open(memory)
                    or not is_pending_input(memory.meta, inputs) or not self._still_waiting(memory)
                    or not (n or _same_system(memory.meta.system, system)) or await self._in_flight(conversation_id)):
                continue
            found.append(memory)
        return max(found, key=lambda m: parse_ts(m.meta.last_activity), default=None)

    async def _in_flight(self, conversation_id: str) -> bool:
        """A turn of the conversation is queued or running on this daemon, or on another of the pool
        (asked only when this one has none): a history must not be continued in place beside it."""
        return bool(self.count_live(conversation_id) or await self.in_line(conversation_id))

    async def _free_at(self, match: Match) -> bool:
        """No turn of the matched conversation is in flight, and its newest exchange is still the
        matched one. Read again after the pool's line was asked: a turn another daemon ended
        between the match and that ask left the line with its exchange already stored, and the
        history, which lacks that exchange, must fork rather than continue after it."""
        conversation_id = match.memory.conversation_id
        if await self._in_flight(conversation_id):
            return False
        memory = await self.cache.get(conversation_id)  # on a pool, asks the store whether it moved
        return memory is not None and not memory.retired and memory.total == match.n

    def _still_waiting(self, memory: ConversationMemory) -> bool:
        """Pending input is matched without the conversation's id only for `pending_window` seconds
        after it was added: a client that pends its input asks at once, and a stranger sending
        the same words later must not join the conversation."""
        added = [parse_ts(entry.ts) for entry in pending_of(memory.meta)]
        return bool(added) and self.clock() - max(added) < self.pending_window

    async def _best(self, matches: list[Match]) -> Match | None:
        if not matches:
            return None
        return max(matches, key=lambda m: (self.is_open(m.memory), m.n == m.memory.total,
                                           parse_ts(m.memory.meta.last_activity)))

    async def _longest_prefix(self, chain: list[str], scope: Scope) -> Match | None:
        """The longest leading part of the history some conversation of `scope` holds. The digest of
        exchange k stands for the whole prefix 1..k (digests are chained), so the store alone is
        asked for the longest k held anywhere, and only the conversations holding that k are
        loaded: 1,000 conversations sharing the first exchange are not read to find the one
        sharing the first two. A k held only where the request may not go (another scope, a
        line the JSONL lookup kept of a conversation since changed) lowers the bound."""
        high = len(chain) - 1
        while high >= 1:
            k = await self._longest_held(chain, high)
            if k is None:
                return None
            found = await self._best(await self._matches(chain[k - 1], k, scope))
            if found is not None:
                return found
            high = k - 1
        return None

    async def _longest_held(self, chain: list[str], high: int) -> int | None:
        """The largest k <= `high` whose digest some stored exchange k holds (a prefix held means
        every shorter one is held too: bisection), asking the store only."""
        low, best = 1, None
        while low <= high:
            middle = (low + high) // 2
            if any(found.n == middle for found in await self.cache.find_digest(chain[middle - 1])):
                best, low = middle, middle + 1
            else:
                high = middle - 1
        return best

    async def _check_same(self, memory: ConversationMemory, n: int, chain: list[str]) -> None:
        """The history must be the conversation's exchanges 1..n: else `history_mismatch` naming the
        first that differs. An exchange stored before digests cannot be compared and is not."""
        for k in range(1, max(n, len(chain)) + 1):
            if k > n or k > len(chain):
                why = ("the history has more exchanges than the conversation" if k > n
                       else "the conversation has more exchanges than the history")
                raise self._mismatch(memory, k, why, len(chain), n)
            stored = await digest_at(self.cache, memory, k, self.max_depth)
            if stored is not None and stored != chain[k - 1]:
                raise self._mismatch(memory, k, "the exchange differs from the stored one", len(chain), n)

    @staticmethod
    def _mismatch(memory: ConversationMemory, k: int, why: str, sent: int, stored: int) -> KsiError:
        return KsiError(ErrorCode.HISTORY_MISMATCH,
                        f"the history differs from conversation {memory.conversation_id} at exchange {k}: {why}",
                        conversation_id=memory.conversation_id, exchange=k, history_exchanges=sent,
                        stored_exchanges=stored, fields={"history": f"differs at exchange {k}"})

    # -- writing ------------------------------------------------------------------
    async def _fork(self, at: Match, digest: str, context: EventContext, data: CompletionAsync) -> str:
        # the digest matched there: the fork records it without reading the parent's index
        fork_data: dict[str, Any] = {"conversation_id": at.memory.conversation_id, "at": at.n, "digest": digest}
        if data.origin is not None:
            fork_data["origin"] = data.origin
        fork = await self.router.request(CONVERSATION_FORK, fork_data, context.child())
        return str(fork["conversation_id"])

    async def _append(self, conversation_id: str, exchanges: list[tuple[list[items.Item], list[items.Item]]],
                      context: EventContext) -> None:
        appended = [{"inputs": [str(i["content"]) for i in inputs],
                     "reply": "".join(str(o["content"]) for o in outputs)} for inputs, outputs in exchanges]
        await self.router.request(CONVERSATION_APPEND, {"conversation_id": conversation_id, "exchanges": appended},
                                  context.child())

    async def _import(self, turns: ClientTurns, context: EventContext, data: CompletionAsync, scope: Scope, *,
                      new_id: str | None = None, linked: Match | None = None) -> str:
        if turns.has_images():
            raise KsiError(ErrorCode.UNSUPPORTED_PARAMETER,
                           "history: a history holding images or PDFs is matched to a stored conversation but "
                           "cannot be imported as a new one (their bytes are not stored here)",
                           fields={"history": "images and PDFs are not imported"})
        document: dict[str, Any] = {
            "format": "ksi.conversation", "v": 1,
            "conversation": {"system": turns.system},
            "exchanges": [{"input": inputs, "output": outputs, "reply": {"content": items.output_text(outputs)}}
                          for inputs, outputs in turns.exchanges],
        }
        request: dict[str, Any] = {"data": document, "format": "json", "for_run": True}
        if new_id is not None:
            request["new_id"] = new_id
        if data.origin is not None:
            request["origin"] = data.origin
        if scope:
            request["scope"] = scope
        if linked is not None:
            request["continues"] = {"conversation_id": linked.memory.conversation_id, "exchange": linked.n}
        imported = await self.router.request(CONVERSATION_IMPORT, request, context.child())
        return str(imported["conversation_id"])


@dataclass(frozen=True, slots=True)
class OwnHistory:
    """The client's own history, as sent to the provider."""

    messages: list[dict[str, Any]]
    exchanges: int
    tokens: int

    def stats(self) -> dict[str, Any]:
        return {"source": "client", "exchanges_total": self.exchanges, "exchanges_sent": self.exchanges,
                "exchanges_omitted": 0, "tokens_sent": self.tokens}


def own_history(data: CompletionAsync, budget: int, count_tokens: Callable[[str], int]) -> OwnHistory | None:
    """The client's own history as the provider's messages when the request has one that fits
    `budget`; None: KSI's budgeted rebuild is sent instead."""
    if not data.history:
        return None
    try:
        turns = split_history(data.history, data.instructions)
    except KsiError:
        return None
    if not turns.exchanges or turns.has_images():
        return None
    messages = turns.messages()
    tokens = sum(count_tokens(items.item_text(item)) + MESSAGE_OVERHEAD
                 for inputs, outputs in turns.exchanges for item in (*inputs, *outputs))
    return OwnHistory(messages, len(turns.exchanges), tokens) if tokens <= budget else None
