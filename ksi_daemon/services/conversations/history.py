"""Rebuilding the messages a stateless model is sent: system, history within budget, new input."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ksi_common.items import ABANDONED_ARGUMENTS, Item, call_ids_abandoned, function_calls
from ksi_common.records import IndexEntry
from ksi_common.transcripts import fork_chain as walk_fork_chain
from ksi_daemon.providers.tool_calls import with_abandoned_arguments, with_calls_answered
from ksi_daemon.services.conversations.memory import ConversationCache, ConversationMemory, Exchange, items_tokens
from ksi_daemon.services.conversations.pending import pending_items

NOTE_RESERVE = 96  # tokens kept free for the notes on the system message (omitted history, answerers)
ANSWERER_LABELS_SHOWN = 4  # the answerers note stays short: at most this many models/agents...
RANGES_SHOWN = 3  # ...each with at most this many runs of exchanges
MESSAGE_OVERHEAD = 4  # tokens a chat message costs beyond its text


@dataclass(slots=True)
class History:
    exchanges: list[Exchange] = field(default_factory=list)  # oldest first
    entries: list[IndexEntry] = field(default_factory=list)  # their index entries, same order
    total: int = 0  # history-eligible exchanges in the conversation (fork chain included)
    tokens: int = 0
    # calls the client abandoned (conversation:abandon_calls): sent with a stand-in for their arguments
    abandoned: set[str] = field(default_factory=set)

    @property
    def omitted(self) -> int:
        return max(0, self.total - len(self.exchanges))

    def stats(self) -> dict[str, int]:
        return {"exchanges_total": self.total, "exchanges_sent": len(self.exchanges),
                "exchanges_omitted": self.omitted, "tokens_sent": self.tokens}


async def fork_chain(
    cache: ConversationCache, memory: ConversationMemory, max_depth: int
) -> list[tuple[ConversationMemory, int | None]]:
    """The conversation and its ancestors, each with the last exchange it contributes (a deleted
    parent ends the chain: the fork keeps only its own exchanges)."""

    async def parent(parent_id: str) -> ConversationMemory | None:
        found = await cache.get(parent_id)
        if found is not None:
            await cache.load_all(found)
        return found

    chain, _missing = await walk_fork_chain(
        memory.conversation_id, memory, lambda m: (m.meta.parent_id, m.meta.fork_at), parent, max_depth)
    return chain


async def newest_exchange(cache: ConversationCache, memory: ConversationMemory, max_depth: int
                          ) -> tuple[IndexEntry, Exchange] | None:
    """The conversation's newest history exchange (a fork's may be its parent's), with its entry."""
    await cache.load_newest(memory)
    own = memory.eligible_between(0, memory.total)
    if own:  # most turns: the conversation's own newest exchange, in memory since its commit
        return own[-1], (await cache.texts(memory, own[-1:]))[0]
    for member, upto in (await fork_chain(cache, memory, max_depth))[1:]:  # a fork with none of its own yet
        entries = member.eligible_between(0, member.total if upto is None else upto)
        if entries:
            return entries[-1], (await cache.texts(member, entries[-1:]))[0]
    return None


async def open_calls(cache: ConversationCache, memory: ConversationMemory, max_depth: int) -> list[Item]:
    """The function calls of the conversation's newest history exchange; the admission rule makes
    the next exchange answer all of them, so they are open."""
    newest = await newest_exchange(cache, memory, max_depth)
    return function_calls(newest[1].output) if newest is not None else []


def with_stand_in_arguments(output: list[Item], abandoned: set[str]) -> list[Item]:
    """`output` with the arguments of the abandoned calls replaced by their stand-in."""
    return [{**item, "arguments": ABANDONED_ARGUMENTS}
            if item.get("type") == "function_call" and str(item.get("call_id")) in abandoned else item
            for item in output]


async def _abandoned_credit(cache: ConversationCache, memory: ConversationMemory, max_depth: int,
                            abandoned: set[str], after: int) -> int:
    """Tokens the newest exchange's stored count holds beyond what it is sent as, when the client
    abandoned its calls (their outputs wait in the pending input): its arguments, too big for the
    window perhaps, are sent as a stand-in, so only the stand-in must fit."""
    newest = await newest_exchange(cache, memory, max_depth) if abandoned else None
    if newest is None or newest[0].n <= after:
        return 0
    entry, exchange = newest
    if not {str(call["call_id"]) for call in function_calls(exchange.output)} & abandoned:
        return 0
    sent = items_tokens(with_stand_in_arguments(exchange.output, abandoned), cache.count_tokens, MESSAGE_OVERHEAD)
    return max(0, entry.tokens_out - sent)


async def _abandoning_caller(cache: ConversationCache, chain: list[tuple[ConversationMemory, int | None]],
                             history: History, room: int, after: int) -> bool:
    """Put before the history the exchange whose calls its first exchange abandoned, when with the
    stand-in arguments it fits `room` (its stored count, the whole arguments, did not); not one
    answering calls itself, whose own partner was left out."""
    first = history.exchanges[0]
    if not call_ids_abandoned(first.input):
        return False
    n = history.entries[0].n
    for member, upto in chain:
        found = member.eligible_between(after, n - 1 if upto is None else min(upto, n - 1))[-1:]
        if not found and not member.complete:
            return False  # older exchanges not loaded: the caller may be among them, so none is guessed
        if not found:
            continue  # none of its own before n: the caller is its parent's
        [caller] = await cache.texts(member, found)
        sent = items_tokens(with_stand_in_arguments(caller.output, history.abandoned), cache.count_tokens,
                            MESSAGE_OVERHEAD)
        if caller.answers_calls or found[0].tokens_in + sent > room:
            return False
        history.exchanges.insert(0, caller)
        history.entries.insert(0, found[0])
        history.tokens += found[0].tokens_in + sent
        return True
    return False


async def select_history(
    cache: ConversationCache, memory: ConversationMemory, budget: int, max_depth: int, after: int = 0,
    step: int = 1,
) -> History:
    """Whole exchanges numbered after `after`, newest first across the fork chain, within `budget`
    tokens (`after` > 0: a summary stands in for exchanges 1..after). When some are left out, the
    first shown is numbered after + 1 + k * `step` (see `stepped`)."""
    history = History(abandoned=set(call_ids_abandoned(pending_items(memory.meta))))
    credit = await _abandoned_credit(cache, memory, max_depth, history.abandoned, after)
    picked: list[tuple[ConversationMemory, list[Any]]] = []
    remaining = budget + credit  # the newest exchange is picked first: the credit is its own
    exhausted = False
    chain = await fork_chain(cache, memory, max_depth)
    for member, upto in chain:
        eligible = member.count_eligible(upto, after)
        if not member.complete:
            eligible += member.unloaded_after(after)  # older exchanges not loaded still count
        history.total += eligible
        if exhausted:
            continue
        entries, used, whole = member.pick(max(remaining, 0), upto, after)
        picked.append((member, entries))
        remaining -= used
        history.tokens += used
        if not whole or not member.complete:
            exhausted = True
    if history.tokens:
        history.tokens -= credit
    if step > 1 and history.total > sum(len(entries) for _member, entries in picked):
        history.tokens -= stepped(picked, after, step)
    for member, entries in reversed(picked):
        history.exchanges.extend(await cache.texts(member, entries))
        history.entries.extend(entries)
    for exchange in history.exchanges:
        history.abandoned.update(call_ids_abandoned(exchange.input))
    # an exchange answering calls goes only with the exchange that made them: when the budget (or a
    # summary) took that one, its outputs leave too, and so on along a chain of tool turns
    while history.exchanges and history.exchanges[0].answers_calls:
        if await _abandoning_caller(cache, chain, history, budget - history.tokens, after):
            break  # the calls it abandoned go with their stand-in arguments, small enough
        entry = history.entries.pop(0)
        history.exchanges.pop(0)
        history.tokens -= entry.tokens_in + entry.tokens_out
    return history


def stepped(picked: list[tuple[ConversationMemory, list[IndexEntry]]], after: int, step: int) -> int:
    """Move the window's start (in `picked`, newest member first) on to the next of the numbers
    after + 1, after + 1 + step, ...; returns the tokens that leaves out. The start then stays put
    while the conversation grows by up to `step` exchanges, so each request extends the previous
    one and a provider's prompt cache holds. A window too small to keep an exchange past the next
    step keeps its start where the budget put it."""
    shown = [entry for _member, entries in picked for entry in entries]
    if not shown:
        return 0
    first = min(entry.n for entry in shown)
    start = after + 1 + -(-(first - after - 1) // step) * step
    if start == first or max(entry.n for entry in shown) < start:
        return 0
    left_out = 0
    for position, (member, entries) in enumerate(picked):
        kept = [entry for entry in entries if entry.n >= start]
        left_out += sum(entry.tokens_in + entry.tokens_out for entry in entries[:len(entries) - len(kept)])
        picked[position] = (member, kept)
    return left_out


@dataclass(slots=True)
class Pinned:
    """Exchanges pinned to stay verbatim in every turn's history, oldest first."""

    entries: list[IndexEntry] = field(default_factory=list)
    exchanges: list[Exchange] = field(default_factory=list)
    tokens: int = 0

    def merge(self, more: Pinned) -> None:
        pairs = sorted([*zip(self.entries, self.exchanges, strict=True),
                        *zip(more.entries, more.exchanges, strict=True)], key=lambda pair: pair[0].n)
        self.entries = [e for e, _x in pairs]
        self.exchanges = [x for _e, x in pairs]
        self.tokens += more.tokens

    def add_to(self, history: History, after: int = 0) -> None:
        """Those the history does not show already go before it (they are older than all it shows);
        one a summary stands in for (numbered up to `after`) now counts among the history's total."""
        shown = {entry.n for entry in history.entries}
        missing = [(e, x) for e, x in zip(self.entries, self.exchanges, strict=True) if e.n not in shown]
        history.entries[:0] = [e for e, _x in missing]
        history.exchanges[:0] = [x for _e, x in missing]
        history.tokens += sum(e.tokens_in + e.tokens_out for e, _x in missing)
        history.total += sum(1 for e, _x in missing if e.n <= after)


async def pinned_exchanges(cache: ConversationCache, memory: ConversationMemory, budget: int,
                           max_depth: int, leave_out: set[int] | frozenset[int] = frozenset()) -> Pinned:
    """The conversation's pinned exchanges along its fork chain (but those in `leave_out`), the
    newest first within `budget` tokens (pinning refuses more than the share; a smaller model's
    window may still hold fewer). Each is looked up by its number: the cost follows the pins, not
    the length of the conversation."""
    pins = sorted(set(memory.meta.pins) - set(leave_out))
    pinned = Pinned()
    if not pins:
        return pinned
    found: list[tuple[ConversationMemory, IndexEntry]] = []
    for member, upto in await fork_chain(cache, memory, max_depth):
        mine = [n for n in pins if upto is None or n <= upto]
        if not mine:
            continue
        if not member.complete:
            await cache.load_all(member)
        claimed = set()
        for n in mine:
            entry = member.entry(n)
            if entry is not None:  # the fork's own exchange; older numbers are its parent's
                claimed.add(n)
                if not entry.is_feedback:
                    found.append((member, entry))
        pins = [n for n in pins if n not in claimed]
    kept: list[tuple[ConversationMemory, IndexEntry]] = []
    for member, entry in sorted(found, key=lambda pair: -pair[1].n):
        cost = entry.tokens_in + entry.tokens_out
        if pinned.tokens + cost <= budget:
            kept.append((member, entry))
            pinned.tokens += cost
    kept.sort(key=lambda pair: pair[1].n)
    by_member: dict[int, tuple[ConversationMemory, list[IndexEntry]]] = {}
    for member, entry in kept:
        by_member.setdefault(id(member), (member, []))[1].append(entry)
    texts: dict[int, Exchange] = {}
    for member, entries in by_member.values():  # one read per member of the chain
        texts.update(zip((e.n for e in entries), await cache.texts(member, entries), strict=True))
    pinned.entries = [entry for _member, entry in kept]
    pinned.exchanges = [texts[entry.n] for entry in pinned.entries]
    return pinned


def omitted_note(count: int, summarised: bool = False) -> str:
    noun = "exchange was" if count == 1 else "exchanges were"
    where = "after the summary " if summarised else ""
    return f"[Note: {count} earlier {noun} {where}left out of this conversation's history to fit the context window.]"


def answerer_label(model: str | None, agent_id: str | None) -> str:
    return f"{agent_id} via {model or 'unknown model'}" if agent_id else (model or "unknown model")


def answerers_note(entries: list[IndexEntry]) -> str | None:
    """Who answered the history shown, when more than one model or agent did; from index entries."""
    runs: dict[str, list[list[int]]] = {}
    previous = None
    for entry in entries:
        if entry.model is None and entry.agent_id is None:
            continue  # a legacy index line does not say who answered
        label = answerer_label(entry.model, entry.agent_id)
        ranges = runs.setdefault(label, [])
        if label == previous:
            ranges[-1][1] = entry.n
        else:
            ranges.append([entry.n, entry.n])
        previous = label
    if len(runs) < 2:
        return None
    parts = []
    for label, ranges in list(runs.items())[:ANSWERER_LABELS_SHOWN]:
        shown = [f"{a}-{b}" if a != b else f"{a}" for a, b in ranges[:RANGES_SHOWN]]
        if len(ranges) > RANGES_SHOWN:
            shown.append("...")
        many = len(ranges) > 1 or ranges[0][0] != ranges[0][1]
        parts.append(f"{label} ({'exchanges' if many else 'exchange'} {', '.join(shown)})")
    if len(runs) > ANSWERER_LABELS_SHOWN:
        parts.append(f"and {len(runs) - ANSWERER_LABELS_SHOWN} more")
    return "[Note: earlier replies came from: " + "; ".join(parts) + ".]"


def system_notes(omitted: int, entries: list[IndexEntry], summary: str | None = None) -> list[str]:
    """What rides on the system message: the summary of left-out exchanges, the note saying how
    many were left out, and who answered the history shown."""
    notes = (summary, omitted_note(omitted, summary is not None) if omitted else None, answerers_note(entries))
    return [note for note in notes if note]


def sent_record(history: History, files: list[dict[str, Any]], stand_in: list[dict[str, Any]] | None
                ) -> dict[str, Any]:
    """What a request sent beyond its own input, compact enough for its response file: the
    exchanges shown (as runs of numbers), how many were left out, what stood in for them (stored
    summaries by owner and range; a fallback made for the turn with its text) and the files. The
    notes follow from these and the index, so they are not stored."""
    runs: list[list[int]] = []
    for entry in history.entries:
        if runs and runs[-1][1] == entry.n - 1:
            runs[-1][1] = entry.n
        else:
            runs.append([entry.n, entry.n])
    record: dict[str, Any] = {"history": runs, "omitted": history.omitted}
    if stand_in:
        record["stand_in"] = stand_in
    if files:
        record["files"] = files
    return record


def build_messages(system: str | None, history: History, new_input: list[dict[str, Any]],
                   summary: str | None = None) -> list[dict[str, Any]]:
    """System (then the summary of left-out exchanges, the omitted and answerers notes) + history as
    user/assistant turns + the new input. The summary rides on the system message so user and
    assistant messages keep alternating."""
    messages: list[dict[str, Any]] = []
    notes = system_notes(history.omitted, history.entries, summary)
    system_text = "\n\n".join([system, *notes] if system else notes)
    if system_text:
        messages.append({"role": "system", "content": system_text})
    for exchange in history.exchanges:
        messages.extend(exchange.chat_messages())
    messages.extend(new_input)
    return with_calls_answered(with_abandoned_arguments(messages, history.abandoned))
