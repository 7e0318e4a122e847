"""Compaction: a summary stands in for the exchanges a long conversation's history leaves out.

After a turn completes, a background job asks which exchanges the next turn will have to leave
out. When that prefix grew past the newest summary, the summariser model is sent the old
summary plus only the newly left-out exchanges, and the extended summary is stored as a record
of its own. Turns never wait for it: a turn uses the newest summary ready, and where none covers
what it leaves out it falls back to the note saying how many exchanges were left out.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog

from ksi_common.settings import Settings
from ksi_common.summaries import Summary
from ksi_common.timefmt import utc_now
from ksi_daemon import eager
from ksi_daemon.context import EventContext
from ksi_daemon.providers.base import Provider, ProviderCall
from ksi_daemon.router import Router, Unregister
from ksi_daemon.services.conversations.history import MESSAGE_OVERHEAD, fork_chain, select_history
from ksi_daemon.services.conversations.memory import ConversationCache, ConversationMemory, Exchange
from ksi_daemon.storage.ports import SummaryStore

log = structlog.get_logger("ksi.compaction")

SUMMARISER_SYSTEM = (
    "You keep the running summary of a conversation between a user and an assistant, so that it "
    "can go on after its older exchanges are dropped. Keep every fact, name, number, decision, "
    "preference and open question; drop greetings and repetition. Write terse plain text, at most "
    "about {words} words. Answer with the summary only."
)
EXCHANGE_TEXT_LIMIT = 8000  # characters of one exchange the summariser is shown


class NoSummaries:
    """Summaries kept for the life of the process only."""

    def __init__(self) -> None:
        self._kept: dict[str, list[Summary]] = {}

    async def append(self, summary: Summary) -> None:
        self._kept.setdefault(summary.conversation_id, []).append(summary)

    async def read(self, conversation_id: str) -> list[Summary]:
        return list(self._kept.get(conversation_id, []))


# (model, system, input tokens, max_tokens) -> the history budget a turn would have
BudgetFor = Callable[[str, str | None, int, int | None], Awaitable[int]]


@dataclass(slots=True)
class _Job:
    task: asyncio.Task[None]
    again: bool = False  # another turn completed while it ran: look once more when done


def summary_block(summary: Summary) -> str:
    """The summary as the rebuilt history shows it, at the head of the history."""
    return f"[Summary of exchanges 1-{summary.upto} of this conversation, which are left out below:]\n{summary.text}"


def transcript_lines(first: int, exchanges: list[Exchange]) -> str:
    lines = []
    for offset, exchange in enumerate(exchanges):
        n = first + offset
        for message in exchange.inputs:
            lines.append(f"[{n}] User: {str(message['content'])[:EXCHANGE_TEXT_LIMIT]}")
        lines.append(f"[{n}] Assistant: {exchange.reply[:EXCHANGE_TEXT_LIMIT]}")
    return "\n".join(lines)


class Compactor:
    """Summaries per conversation: found for a turn, extended in the background."""

    def __init__(self, settings: Settings, router: Router, cache: ConversationCache, store: SummaryStore,
                 provider: Provider, count_tokens: Callable[[str], int], budget_for: BudgetFor) -> None:
        self.settings = settings
        self.router = router
        self.cache = cache
        self.store = store
        self.provider = provider
        self.count_tokens = count_tokens
        self.budget_for = budget_for
        self._jobs: dict[str, _Job] = {}
        self._failures: dict[str, int] = {}
        self._retries: dict[str, asyncio.TimerHandle] = {}
        self.calls = 0  # summariser calls made, for health

    def register(self) -> list[Unregister]:
        return [self.router.listen("completion:result", self._on_result), self.router.emits("conversation:summarised")]

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
        """The model that writes this model's conversations' summaries; None when compaction is off."""
        chosen = self.settings.model_settings(model).summariser or self.settings.summariser
        if chosen == "off" or (not chosen and model.startswith(("consortium/", "claude-cli/", "gemini-cli/"))):
            return None  # answerers with their own memory (or no single model) need an explicit summariser
        return chosen or model

    def health(self) -> dict[str, Any]:
        return {"running": len(self._jobs), "retrying": len(self._retries), "calls": self.calls}

    # -- reading ------------------------------------------------------------
    async def summaries(self, memory: ConversationMemory) -> list[Summary]:
        """Kept on the conversation in memory, so they leave with it (eviction, reset, delete)."""
        if memory.summaries is None:
            memory.summaries = await self.store.read(memory.conversation_id)
        return memory.summaries

    async def for_turn(self, memory: ConversationMemory, model: str) -> Summary | None:
        """The newest summary this conversation may use: its own, or an ancestor's that covers only
        the prefix the fork shares (a fork at k never sees a summary of the parent's later turns)."""
        if self.summariser(model) is None:
            return None
        return await self._newest(memory)

    async def _newest(self, memory: ConversationMemory) -> Summary | None:
        best: Summary | None = None
        for member, upto in await fork_chain(self.cache, memory, self.settings.max_fork_depth):
            for summary in reversed(await self.summaries(member)):
                if upto is not None and summary.upto > upto:
                    continue
                if best is None or summary.upto > best.upto:
                    best = summary
                break
        return best

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
        """Extend the conversation's summary if the next turn would leave out more than it covers."""
        summariser = self.summariser(model)
        # Most looks find nothing to do, so they look at the conversation as this daemon holds it
        # (no query to a shared store); a look that will pay a summariser checks first.
        memory = self.cache.cached(conversation_id) or await self.cache.get(conversation_id)
        if summariser is None or memory is None or not memory.entries:
            return None
        last = memory.entries[-1]
        budget = await self.budget_for(model, memory.meta.system, last.tokens_in, None)
        current = await self._newest(memory)
        covered = current.upto if current is not None else 0
        reserve = self.settings.summary_max_tokens + MESSAGE_OVERHEAD
        history = await select_history(self.cache, memory, budget - reserve, self.settings.max_fork_depth, covered)
        if not history.omitted:
            return None  # everything after the summary still fits
        first_kept = history.entries[0].n if history.entries else memory.next_n
        # summarise a few exchanges ahead, so the summariser runs once every `compaction_step` turns
        target = min(first_kept - 1 + self.settings.compaction_step - 1, memory.next_n - 2)
        if target <= covered:
            return None
        if self.cache.store.shared and not await self.cache.fresh(memory):
            return await self.extend(conversation_id, model)  # another daemon moved it: decide again
        exchanges = await self._exchanges(memory, covered, target)
        summary = await self._summarise(memory.conversation_id, summariser, current, covered + 1, exchanges, target)
        known = await self.summaries(memory)
        now_cached = self.cache.cached(conversation_id)
        if now_cached is not None and now_cached is not memory:
            return None  # reset meanwhile: this summary is of the conversation that moved away
        await self.store.append(summary)
        known.append(summary)
        log.info("summary_written", conversation_id=conversation_id, upto=target, previous_upto=covered,
                 model=summariser, tokens=summary.tokens)
        self.router.emit("conversation:summarised", {
            "conversation_id": conversation_id, "upto": target, "previous_upto": covered,
            "model": summariser, "tokens": summary.tokens, "cost": summary.cost,
        }, EventContext.root())
        await self._count_usage(memory, summary)
        return summary

    async def _exchanges(self, memory: ConversationMemory, after: int, upto: int) -> list[Exchange]:
        """The history-eligible exchanges after < n <= upto along the fork chain, oldest first."""
        picked: list[Exchange] = []
        for member, limit in reversed(await fork_chain(self.cache, memory, self.settings.max_fork_depth)):
            if not member.complete:
                await self.cache.load_all(member)
            entries = member.eligible_between(after, upto if limit is None else min(upto, limit))
            picked.extend(await self.cache.texts(member, entries))
        return picked

    async def _summarise(self, conversation_id: str, summariser: str, current: Summary | None, first: int,
                         exchanges: list[Exchange], upto: int) -> Summary:
        words = max(50, int(self.settings.summary_max_tokens * 0.6))
        parts = []
        if current is not None:
            parts.append(f"Summary of exchanges 1-{current.upto}:\n{current.text}")
        parts.append(f"Exchanges {first}-{upto}:\n{transcript_lines(first, exchanges)}")
        parts.append(f"Write the summary of exchanges 1-{upto}.")
        call = ProviderCall(
            model=summariser,
            messages=[{"role": "system", "content": SUMMARISER_SYSTEM.format(words=words)},
                      {"role": "user", "content": "\n\n".join(parts)}],
            max_tokens=self.settings.summary_max_tokens, timeout=self.settings.request_timeout,
            request={"conversation_id": conversation_id, "purpose": "summary"},
        )
        self.calls += 1
        reply = await self.provider.complete(call)
        text = reply.content.strip()
        if not text:
            raise ValueError("the summariser answered with nothing")
        return Summary(conversation_id=conversation_id, upto=upto, text=text, model=summariser,
                       tokens=self.count_tokens(text) + MESSAGE_OVERHEAD, previous_upto=current.upto if current else 0,
                       usage=dict(reply.usage), cost=float(reply.cost or 0.0), ts=utc_now())

    async def _count_usage(self, memory: ConversationMemory, summary: Summary) -> None:
        """A summary's tokens and cost are the conversation's usage too."""
        async with memory.lock:
            meta = memory.meta.model_copy(deep=True)
            meta.tokens_in += summary.usage.get("prompt_tokens", 0)
            meta.tokens_out += summary.usage.get("completion_tokens", 0)
            meta.cost += summary.cost
            compaction = dict(meta.extra.get("compaction") or {})
            compaction["summaries"] = int(compaction.get("summaries", 0)) + 1
            compaction["covered"] = summary.upto
            compaction["cost"] = float(compaction.get("cost", 0.0)) + summary.cost
            meta.extra["compaction"] = compaction
            await self.cache.store.save_meta(meta)
            memory.meta = meta
