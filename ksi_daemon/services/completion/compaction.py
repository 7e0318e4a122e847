"""Compaction: summaries stand in for the exchanges a long conversation's history leaves out.

After a turn completes, a background job asks which exchanges the next turn will leave out with
the summaries' share of the budget reserved. When that reaches past what the stored summaries
cover, the summariser is sent only the newly left-out exchanges (a chunk, a step ahead) and its
answer is stored beside the earlier chunks; nothing is ever rewritten from an earlier summary
alone. A candidate is checked before it is stored (salience.check_candidate); one that fails is
asked for once more with what it dropped, then replaced by a fallback written without a model.
When the chunks together outgrow their share they are merged, section by section, from the
chunks themselves (merges of merges at most `summary_max_levels` deep).

Turns never wait for any of it: a turn uses the chunks stored, and exchanges left out that no
chunk covers yet are represented by the fallback, computed for that turn.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from ksi_common.events import COMPLETION_RESULT, CONVERSATION_SUMMARISED
from ksi_common.items import item_text
from ksi_common.records import IndexEntry
from ksi_common.settings import Settings
from ksi_common.summaries import Summary
from ksi_common.timefmt import utc_now
from ksi_daemon import eager
from ksi_daemon.context import EventContext
from ksi_daemon.providers.base import Provider, ProviderCall
from ksi_daemon.router import Router, Unregister
from ksi_daemon.services.completion.salience import (
    EXCHANGE_TEXT_LIMIT,
    Verdict,
    check_candidate,
    digest,
    exchange_items,
    fallback_text,
    text_items,
)
from ksi_daemon.services.conversations.history import MESSAGE_OVERHEAD, fork_chain, select_history
from ksi_daemon.services.conversations.inherited import fork_point_turn, inherited_summaries
from ksi_daemon.services.conversations.memory import (
    NEWEST_TAIL_BUDGET,
    ConversationCache,
    ConversationMemory,
    Exchange,
)
from ksi_daemon.services.conversations.salient import Items
from ksi_daemon.services.conversations.stand_ins import Block, StandIn, cover, summary_block
from ksi_daemon.services.conversations.turn_budget import MIN_SUMMARY_TOKENS, summaries_share
from ksi_daemon.services.conversations.writer import ConversationWriter
from ksi_daemon.storage.models import CompactionTally

log = structlog.get_logger("ksi.compaction")

SECTIONS = ("User and goals", "Facts and figures", "Decisions", "Open questions and tasks",
            "Tool calls and results", "Files")
SUMMARISER_SYSTEM = (
    "You summarise part of a conversation between a user and an assistant, so that it can go on "
    "after these exchanges are dropped. Keep every name, number, date, identifier, path, URL, quoted "
    "string, and everything the user said about themselves, their goals and their decisions, in "
    "their own words where short. Drop greetings and repetition; do not copy the transcript. Answer "
    "with these sections only, each a few terse lines or 'none':\n" + "\n".join(f"## {s}" for s in SECTIONS)
    + "\nAt most about {words} words."
)
MERGE_REQUEST = "Merge these summaries of consecutive parts of one conversation into one, section by section."
GAP_EXCHANGES = 64  # a turn's fallback reads at most this many left-out exchanges not yet covered
LOAD_ROUNDS = 6  # index tails read, each four times wider, before the whole index is read instead
# a stand-in block's header line ("[Summary of exchanges 1-40 of this conversation, ...]"), at most:
# counted as this instead of counting each rendering again
BLOCK_HEADER_TOKENS = 28
# (model, system, input tokens, max_tokens) -> the history budget a turn would have
BudgetFor = Callable[[str, str | None, int, int | None], Awaitable[int]]


class ConversationGone(Exception):
    """The conversation was deleted or reset while a summary of it was being written."""


@dataclass(slots=True)
class Rejected:
    """The candidates a summariser gave that failed their checks, and what they cost."""

    candidates: list[dict[str, Any]] = field(default_factory=list)
    usage: dict[str, int] = field(default_factory=dict)
    cost: float = 0.0


@dataclass(slots=True)
class _Job:
    task: asyncio.Task[None]
    again: bool = False  # another turn completed while it ran: look once more when done


def transcript_lines(first: int, exchanges: list[Exchange]) -> str:
    lines = []
    for offset, exchange in enumerate(exchanges):
        n = first + offset
        # tool calls and their outputs are shown too, so a summary of a tool turn can mention them
        for item in exchange.input:
            who = "Tool" if item.get("type") == "function_call_output" else "User"
            lines.append(f"[{n}] {who}: {item_text(item)[:EXCHANGE_TEXT_LIMIT]}")
        for item in exchange.output:
            if item.get("type") != "reasoning":
                lines.append(f"[{n}] Assistant: {item_text(item)[:EXCHANGE_TEXT_LIMIT]}")
    return "\n".join(lines)


class Compactor:
    """Summaries per conversation: found for a turn, written in the background."""

    def __init__(self, settings: Settings, router: Router, cache: ConversationCache, writer: ConversationWriter,
                 provider: Provider, count_tokens: Callable[[str], int], budget_for: BudgetFor,
                 answerer_for: Callable[[str], Provider]) -> None:
        self.settings = settings
        self.router = router
        self.cache = cache
        self.writer = writer  # summaries and the metadata counting them are written through it
        self.provider = provider
        self.answerer_for = answerer_for  # what answers a conversation's model
        self.count_tokens = count_tokens
        self.budget_for = budget_for
        self._jobs: dict[str, _Job] = {}
        self._failures: dict[str, int] = {}
        self._retries: dict[str, asyncio.TimerHandle] = {}
        self.calls = 0  # summariser calls made, for health
        self.fallbacks = 0  # fallbacks stored where no candidate passed its checks

    def register(self) -> list[Unregister]:
        return [self.router.listen(COMPLETION_RESULT, self._on_result), self.router.emits(CONVERSATION_SUMMARISED)]

    async def stop(self, timeout: float) -> None:
        for handle in self._retries.values():
            handle.cancel()
        self._retries.clear()
        jobs = [job.task for job in self._jobs.values()]
        for task in jobs:
            task.cancel()
        if jobs:
            await asyncio.wait(jobs, timeout=timeout)

    def summariser(self, model: str) -> str | None:
        """The model that writes this model's conversations' summaries; None when none does."""
        chosen = self.settings.model_settings(model).summariser or self.settings.summariser
        answerer = self.answerer_for(model)
        if chosen == "off" or (not chosen and (answerer.keeps_session or not answerer.takes_slot)):
            return None  # answerers with their own memory (or no single model) need an explicit summariser
        return chosen or model

    def off(self, model: str) -> bool:
        """Compaction switched off: only the note says what was left out (no fallback either)."""
        return (self.settings.model_settings(model).summariser or self.settings.summariser) == "off"

    def health(self) -> dict[str, Any]:
        return {"running": len(self._jobs), "retrying": len(self._retries), "calls": self.calls,
                "fallbacks": self.fallbacks}

    def share(self, budget: int) -> int:
        return summaries_share(budget, self.settings.summary_share)

    # -- reading ------------------------------------------------------------
    async def summaries(self, memory: ConversationMemory) -> list[Summary]:
        """Kept on the conversation in memory, so they leave with it (eviction, reset, delete)."""
        if memory.summaries is None:
            memory.summaries = await self.writer.summaries(memory.conversation_id)
        return memory.summaries

    async def _cover(self, memory: ConversationMemory) -> list[Summary]:
        """The summaries standing in for exchanges 1..n: a fork's ancestors' only those the turn
        after its fork point had to choose from (conversations.inherited), so it opens as that turn did."""
        chain = await fork_chain(self.cache, memory, self.settings.max_fork_depth)
        found = [await self.summaries(member) for member, _upto in chain]
        return cover(inherited_summaries(chain, found, await fork_point_turn(self.cache, chain)))

    async def for_turn(self, memory: ConversationMemory, model: str, budget: int,
                       share: int | None = None) -> StandIn | None:
        """What stands in for the exchanges this turn leaves out: the stored summaries covering
        them from exchange 1, then this turn's fallback for those no summary covers yet, within
        the summaries' `share` of `budget` (a stored summary that does not fit is cut to its items)."""
        if self.off(model):
            return None
        share = self.share(budget) if share is None else share
        kept = await select_history(self.cache, memory, budget - share, self.settings.max_fork_depth)
        if not kept.omitted:
            return None
        left_out = kept.entries[0].n - 1 if kept.entries else memory.next_n - 1
        stored = await self._cover(memory)
        covered = stored[-1].upto if stored else 0
        # exchanges no summary covers yet: their items are kept first, their inputs get what is left
        gap = await self._numbered(memory, max(covered, left_out - GAP_EXCHANGES), left_out) \
            if left_out > covered else []
        items = exchange_items([x for _n, x in gap])  # once, for both renderings of the gap
        essential_text = fallback_text(gap, share // 2, self.count_tokens, False, items)
        essential_cost = self.count_tokens(essential_text) + BLOCK_HEADER_TOKENS
        room = share - (essential_cost if gap else 0)
        blocks = [summary_block(s) for s in stored]
        costs = [self._cost(s) for s in stored]  # their stored counts: no summary is counted again
        for i, block in enumerate(blocks):  # the oldest give way first, to their items
            if sum(costs) <= room:
                break
            blocks[i] = Block(block.first, block.upto, "digest", digest(block.text, room, self.count_tokens),
                              block.owner)
            costs[i] = self.count_tokens(blocks[i].text) + BLOCK_HEADER_TOKENS
        if stored and sum(costs) > room:  # too many even as items: the items of them all, the oldest first
            whole = Block(1, covered, "digest", "")
            whole.text = digest("\n".join(s.text for s in stored), room - BLOCK_HEADER_TOKENS, self.count_tokens)
            blocks = [whole]
            costs = [self.count_tokens(whole.text) + BLOCK_HEADER_TOKENS]
        if gap:
            text = fallback_text(gap, share - sum(costs) - BLOCK_HEADER_TOKENS, self.count_tokens, True, items)
            if len(text) > len(essential_text):
                blocks.append(Block(covered + 1, left_out, "recent", text))
                costs.append(self.count_tokens(text) + BLOCK_HEADER_TOKENS)
            else:
                blocks.append(Block(covered + 1, left_out, "recent", essential_text))
                costs.append(essential_cost)
        stand_in = StandIn(blocks)
        if not stand_in.blocks:
            return None
        stand_in.tokens = sum(cost + 2 for cost in costs)
        return stand_in

    def _cost(self, summary: Summary) -> int:
        """A stored summary's tokens as a block of the stand-in: its stored count (a legacy record
        without one is counted) and the header's."""
        return (summary.tokens or self.count_tokens(summary.text)) + BLOCK_HEADER_TOKENS

    async def _numbered(self, memory: ConversationMemory, after: int, upto: int,
                        budget: int | None = None) -> list[tuple[int, Exchange]]:
        """Exchanges after < n <= upto with their numbers, oldest first, along the fork chain; with
        a `budget`, only the oldest that fit in it by their indexed counts (at least one). Only the
        texts of those taken are read."""
        found: list[tuple[ConversationMemory, IndexEntry]] = []
        for member, limit in reversed(await fork_chain(self.cache, memory, self.settings.max_fork_depth)):
            await self._load_after(member, after)
            last = upto if limit is None else min(upto, limit)
            found.extend((member, entry) for entry in member.eligible_between(after, last))
        if budget is not None:
            used, taken = 0, 0
            for _member, entry in found:  # each exchange counted once
                used += entry.tokens_in + entry.tokens_out
                if taken and used > budget:
                    break
                taken += 1
            found = found[:taken]
        groups: list[tuple[ConversationMemory, list[IndexEntry]]] = []
        for member, entry in found:
            if groups and groups[-1][0] is member:
                groups[-1][1].append(entry)
            else:
                groups.append((member, [entry]))
        picked: list[tuple[int, Exchange]] = []
        for member, entries in groups:  # one read per member of the fork chain
            texts = await self.cache.texts(member, entries)
            picked.extend((entry.n, text) for entry, text in zip(entries, texts, strict=True))
        return picked

    async def _load_after(self, memory: ConversationMemory, after: int) -> None:
        """The index entries numbered after `after` loaded: the index's tail read wider each round,
        so a cold conversation's turn reads its gap's entries, not its whole index."""
        budget = max(memory.tail_budget, NEWEST_TAIL_BUDGET)
        for _round in range(LOAD_ROUNDS):
            if memory.complete or not memory.unloaded_after(after):
                return
            budget *= 4
            await self.cache.widen(memory, budget)
        if not memory.complete and memory.unloaded_after(after):
            await self.cache.load_all(memory)

    # -- writing ------------------------------------------------------------
    def _on_result(self, _name: str, data: dict[str, Any], _context: EventContext) -> None:
        conversation_id, model = data.get("conversation_id"), data.get("model")
        if not conversation_id or not model or self.summariser(model) is None:
            return
        self.kick(conversation_id, model)

    def kick(self, conversation_id: str, model: str) -> None:
        """Look at a conversation in the background (at most one job per conversation)."""
        job = self._jobs.get(conversation_id)
        if job is not None:
            job.again = True
            return
        if conversation_id in self._retries:
            return  # a failed summariser is waiting out its back-off
        # most looks find nothing to do without waiting for anything: started eagerly, those end
        # here, and only a look that waits (for a summariser) stays a job
        started = eager.start(self._run(conversation_id, model))
        if not started.finished:
            self._jobs[conversation_id] = _Job(started.task)

    async def _run(self, conversation_id: str, model: str) -> None:
        try:
            while True:
                try:
                    await self.extend(conversation_id, model)
                    self._failures.pop(conversation_id, None)
                except asyncio.CancelledError:
                    raise
                except ConversationGone:
                    return  # deleted or reset while its summary was written: nothing more to do
                except Exception as exc:
                    self._retry_later(conversation_id, model, exc)
                    return
                job = self._jobs.get(conversation_id)
                if job is None or not job.again:
                    return
                job.again = False
        finally:
            self._jobs.pop(conversation_id, None)

    def _retry_later(self, conversation_id: str, model: str, exc: Exception) -> None:
        failures = self._failures.get(conversation_id, 0) + 1
        self._failures[conversation_id] = failures
        delay = min(self.settings.summary_retry_delay * 2 ** (failures - 1), self.settings.summary_retry_max_delay)
        log.warning("summary_failed", conversation_id=conversation_id, model=model,
                    code=getattr(exc, "code", type(exc).__name__), error=str(exc)[:300],
                    failures=failures, retry_in=delay)

        def retry() -> None:
            self._retries.pop(conversation_id, None)
            self.kick(conversation_id, model)

        self._retries[conversation_id] = asyncio.get_running_loop().call_later(delay, retry)

    async def extend(self, conversation_id: str, model: str) -> Summary | None:
        """Summarise the exchanges the next turn leaves out beyond what is covered (a step ahead),
        then merge when the summaries outgrow their share."""
        summariser = self.summariser(model)
        # Most looks find nothing to do, so they look at the conversation as this daemon holds it
        # (no query to a shared store); a look that will pay a summariser checks first.
        memory = self.cache.cached(conversation_id) or await self.cache.get(conversation_id)
        if summariser is None or memory is None or not memory.entries:
            return None
        last = memory.entries[-1]
        budget = await self.budget_for(model, memory.meta.system, last.tokens_in, None)
        share = self.share(budget)
        kept = await select_history(self.cache, memory, budget - share, self.settings.max_fork_depth)
        if not kept.omitted:
            return None  # nothing is about to be left out
        left_out = kept.entries[0].n - 1 if kept.entries else memory.next_n - 1
        stored = await self._cover(memory)
        covered = stored[-1].upto if stored else 0
        if left_out <= covered:
            return await self._merge(memory, summariser, stored, share)
        # a step ahead, so the summariser runs once every `compaction_step` turns (never the newest)
        target = max(left_out, min(left_out + self.settings.compaction_step - 1, memory.next_n - 2))
        if self.writer.shared and not await self.cache.fresh(memory):
            return await self.extend(conversation_id, model)  # another daemon moved it: decide again
        # the summariser's prompt must fit: a long stretch goes in several chunks
        exchanges = await self._numbered(memory, covered, target, budget)
        if not exchanges:
            return None
        guard = not self._failures.get(conversation_id)  # a summariser failing again gives way to the fallback
        chunk = await self._chunk(memory, summariser, exchanges, share, guard)
        await self._store(memory, chunk)
        return await self._merge(memory, summariser, [*stored, chunk], share) or chunk

    def _limit(self, share: int, part: int) -> int:
        return max(MIN_SUMMARY_TOKENS, min(self.settings.summary_max_tokens, share // part))

    async def _chunk(self, memory: ConversationMemory, summariser: str, exchanges: list[tuple[int, Exchange]],
                     share: int, guard: bool) -> Summary:
        first, upto = exchanges[0][0], exchanges[-1][0]
        texts = [x for _n, x in exchanges]
        source = transcript_lines(first, texts)
        limit = self._limit(share, 3)
        request = f"Exchanges {first}-{upto}:\n{source}\n\nWrite the summary of exchanges {first}-{upto}."
        summary, rejected = await self._candidate(memory, summariser, request, exchange_items(texts),
                                                  self.count_tokens(source), limit, first, upto, 0, guard)
        if summary is None:
            text = fallback_text(exchanges, limit, self.count_tokens)
            summary = self._fallback(memory, first, upto, 0, text, rejected)
        return summary

    async def _merge(self, memory: ConversationMemory, summariser: str, stored: list[Summary],
                     share: int) -> Summary | None:
        """Merge the oldest summaries (all but the newest, none already at the deepest level)
        once together they outgrow their share."""
        if sum(self._cost(s) for s in stored) <= share:
            return None
        start = max((i + 1 for i, s in enumerate(stored) if s.level >= self.settings.summary_max_levels), default=0)
        parts = stored[start:-1]
        if len(parts) < 2:
            return None
        first, upto, level = parts[0].first, parts[-1].upto, max(s.level for s in parts) + 1
        source = "\n\n".join(f"Summary of exchanges {s.first}-{s.upto}:\n{s.text}" for s in parts)
        items = Items()
        for part in parts:
            found = text_items(part.text)
            items.user.extend(found.user)
            items.facts.extend(found.facts)
        items.user, items.facts = list(dict.fromkeys(items.user)), list(dict.fromkeys(items.facts))
        limit = self._limit(share, 2)
        request = f"{source}\n\n{MERGE_REQUEST} Write the summary of exchanges {first}-{upto}."
        merged, rejected = await self._candidate(memory, summariser, request, items, self.count_tokens(source),
                                                 limit, first, upto, level, guard=False)
        if merged is None:
            merged = self._fallback(memory, first, upto, level, digest(source, limit, self.count_tokens), rejected)
        await self._store(memory, merged)
        return merged

    async def _candidate(self, memory: ConversationMemory, summariser: str, request: str, items: Items,
                         source_tokens: int, limit: int, first: int, upto: int, level: int,
                         guard: bool) -> tuple[Summary | None, Rejected]:
        """A checked summary, asked for at most twice (the second time with what the first
        dropped); None when neither passes. A failing summariser raises on a chunk (`guard`: it
        is retried later) and gives way to the fallback on a merge."""
        verdicts: list[Verdict] = []
        usage: dict[str, int] = {}
        cost = 0.0
        for _attempt in range(2):
            prompt = request
            if verdicts:
                prompt += (f"\n\nYour previous answer could not be used ({', '.join(verdicts[-1].reasons)}). "
                           f"Answer with the summary only, under {limit} tokens.")
                if verdicts[-1].missing:
                    prompt += " It must keep these items: " + "; ".join(verdicts[-1].missing[:40])
            try:
                text, used, spent = await self._ask(memory.conversation_id, summariser, prompt, limit)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if guard and not verdicts:
                    raise
                verdicts.append(Verdict(False, [f"error:{getattr(exc, 'code', type(exc).__name__)}"]))
                break
            for key, value in used.items():
                usage[key] = usage.get(key, 0) + int(value or 0)
            cost += spent
            verdict = check_candidate(text, items, source_tokens, limit, self.count_tokens)
            verdicts.append(verdict)
            if verdict.ok:
                return Summary(conversation_id=memory.conversation_id, upto=upto, text=text.strip(),
                               model=summariser, tokens=self.count_tokens(text.strip()) + MESSAGE_OVERHEAD,
                               usage=usage, cost=cost, ts=utc_now(), first=first, level=level,
                               checks={"candidates": [v.to_record() for v in verdicts]}), Rejected()
        log.info("summary_rejected", conversation_id=memory.conversation_id, first=first, upto=upto,
                 reasons=[v.reasons for v in verdicts])
        return None, Rejected([v.to_record() for v in verdicts], usage, cost)

    async def _ask(self, conversation_id: str, summariser: str, prompt: str, limit: int
                   ) -> tuple[str, dict[str, int], float]:
        words = max(30, int(limit * 0.6))
        call = ProviderCall(
            model=summariser,
            messages=[{"role": "system", "content": SUMMARISER_SYSTEM.replace("{words}", str(words))},
                      {"role": "user", "content": prompt}],
            temperature=self.temperature(summariser),
            max_tokens=min(self.settings.summary_max_tokens, limit * 2),
            timeout=self.settings.request_timeout,
            request={"conversation_id": conversation_id, "purpose": "summary"},
        )
        self.calls += 1
        reply = await self.provider.complete(call)
        return reply.content, dict(reply.usage), float(reply.cost or 0.0)

    def temperature(self, summariser: str) -> float:
        """Summaries are sampled deterministically unless the summariser's settings say otherwise."""
        chosen = self.settings.model_settings(summariser).summary_temperature
        return 0.0 if chosen is None else chosen

    def _fallback(self, memory: ConversationMemory, first: int, upto: int, level: int, text: str,
                  rejected: Rejected) -> Summary:
        self.fallbacks += 1
        return Summary(conversation_id=memory.conversation_id, upto=upto, text=text, model=None,
                       tokens=self.count_tokens(text) + MESSAGE_OVERHEAD, usage=rejected.usage,
                       cost=rejected.cost, ts=utc_now(), first=first, kind="fallback", level=level,
                       checks={"candidates": rejected.candidates})

    async def _store(self, memory: ConversationMemory, summary: Summary) -> None:
        """Stored only while the conversation is the one it summarises: under its lock, and never
        after it was deleted or reset meanwhile (that write would bring back a ghost of it)."""
        conversation_id = memory.conversation_id
        async with memory.lock:
            if memory.retired or self.cache.cached(conversation_id) is not memory:
                log.info("summary_dropped", conversation_id=conversation_id, upto=summary.upto)
                raise ConversationGone(conversation_id)
            await self.writer.add_summary(summary)
            known = await self.summaries(memory)
            known.append(summary)
            meta = memory.meta.model_copy(deep=True)
            meta.tokens_in += summary.usage.get("prompt_tokens", 0)
            meta.tokens_out += summary.usage.get("completion_tokens", 0)
            meta.cost += summary.cost
            meta.compaction = (meta.compaction or CompactionTally()).added(summary.upto, summary.cost, summary.fallback)
            await self.writer.save_meta(memory, meta)
        log.info("summary_written", conversation_id=conversation_id, first=summary.first, upto=summary.upto,
                 kind=summary.kind, level=summary.level, tokens=summary.tokens)
        self.router.emit(CONVERSATION_SUMMARISED, {
            "conversation_id": conversation_id, "first": summary.first, "upto": summary.upto,
            "kind": summary.kind, "level": summary.level, "model": summary.model, "tokens": summary.tokens,
            "cost": summary.cost,
        }, EventContext.root())
