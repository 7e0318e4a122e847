"""Preparing a turn: the token budget, the history within it (compaction's stand-in for what is
left out, pinned exchanges), calibration of the daemon's count, attachments and images, and the
provider call they make."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ksi_common.items import Item, media_parts
from ksi_common.settings import Settings
from ksi_daemon.providers.base import ChunkSink, ProviderCall
from ksi_daemon.providers.tool_calls import input_messages
from ksi_daemon.services.completion import exchange_records as records
from ksi_daemon.services.completion import tool_turns
from ksi_daemon.services.completion.admission import check_open
from ksi_daemon.services.completion.answerers import Answerers
from ksi_daemon.services.completion.attachments import Attached, Attachments
from ksi_daemon.services.completion.breakpoints import Part, labelled, layout
from ksi_daemon.services.completion.calibration import Calibration
from ksi_daemon.services.completion.client_history import OwnHistory, own_history
from ksi_daemon.services.completion.compaction import Compactor
from ksi_daemon.services.completion.images import Images
from ksi_daemon.services.completion.requests import RequestState
from ksi_daemon.services.conversations.history import (
    MESSAGE_OVERHEAD,
    NOTE_RESERVE,
    History,
    build_messages,
    sent_record,
)
from ksi_daemon.services.conversations.memory import ConversationCache, ConversationMemory, items_tokens
from ksi_daemon.services.conversations.pending import with_pending
from ksi_daemon.services.conversations.planner import TurnPlan, TurnPlanner
from ksi_daemon.services.conversations.stand_ins import stable_parts
from ksi_daemon.services.conversations.turn_budget import TurnBudget, summaries_share
from ksi_daemon.storage.models import ConversationMeta


class ModelFacts(Protocol):
    """What the completion path needs to know about models to budget a turn's tokens."""

    async def ready(self, model: str) -> None: ...

    def count_tokens(self, text: str) -> int: ...

    async def context_window(self, model: str) -> int: ...

    def output_reserve(self, model: str, max_tokens: int | None) -> int: ...


class HistoryBudget:
    """A turn's window split into its shares, in the daemon's count (the learned calibration ratio)."""

    def __init__(self, settings: Settings, facts: ModelFacts, calibration: Calibration) -> None:
        self.settings = settings
        self.facts = facts
        self.calibration = calibration

    async def turn(self, model: str, system: str | None, input_tokens: int, max_tokens: int | None) -> TurnBudget:
        """The shares of a turn of `model`: history is the window less the answer's reserve, the
        system prompt, the new input and the notes.

        The window and the answer's reserve are the model's own tokens; dividing by the learned
        ratio turns them into the daemon's estimate, in which every stored count is kept.
        """
        window = await self.facts.context_window(model)
        reserve = self.facts.output_reserve(model, max_tokens)
        ratio = self.calibration.ratio(model)
        system_tokens = self.facts.count_tokens(system) + MESSAGE_OVERHEAD if system else 0
        history = int((window - reserve) / ratio) - system_tokens - input_tokens - NOTE_RESERVE
        return TurnBudget(model, window, reserve, ratio, system_tokens, input_tokens, NOTE_RESERVE, history,
                          summaries=summaries_share(history, self.settings.summary_share),
                          pins=int(history * self.settings.pins_share),
                          files_share=self.settings.files_budget_share)

    async def history(self, model: str, system: str | None, input_tokens: int, max_tokens: int | None) -> int:
        """Tokens (as the daemon counts them) left for history in a turn of `model`."""
        return (await self.turn(model, system, input_tokens, max_tokens)).history

    async def pins(self, meta: ConversationMeta) -> int:
        """The tokens a conversation's pinned exchanges may take: their share of the history budget
        of a turn of its latest model with an empty input."""
        model = meta.models[-1] if meta.models else self.settings.default_model
        return max(0, (await self.turn(model, meta.system, 0, None)).pins)


@dataclass(slots=True)
class TurnInput:
    """A request's new input as this turn sends it, with the system prompts it names."""

    inputs: list[dict[str, Any]]  # the raw input lines for the response file
    new_items: list[Item]  # the new input as the model sees it
    tokens: int  # its tokens, images included
    new_system: str | None  # a system prompt the input sets for the conversation
    system: str | None  # the conversation's system prompt after this turn
    sent_system: str | None  # the one sent: the request's instructions, else the conversation's


@dataclass(slots=True)
class Prepared:
    """A turn ready to run: the provider call, and what its commit stores beside the answer."""

    memory: ConversationMemory
    call: ProviderCall
    system: str | None
    system_changed: bool
    inputs: list[dict[str, Any]]  # the raw input lines for the response file
    new_items: list[Item]  # the new input as the model sees it
    input_tokens: int
    history_stats: dict[str, int]
    files: list[dict[str, Any]] = field(default_factory=list)  # {path, size, sha256} of the new input's files
    estimate: int = 0  # the whole prompt as the daemon counts it (before calibration)
    sent: dict[str, Any] = field(default_factory=dict)  # what else was sent: history shown, summary, files
    layout: list[Part] = field(default_factory=list)  # what each message of the call is
    stable_kinds: list[str] = field(default_factory=list)  # "system" or "summary": each stable part of the call

    def sent_record(self, placed: list[dict[str, Any]]) -> dict[str, Any]:
        """The record of what was sent, with the breakpoints the provider placed, by part."""
        return {**self.sent, "breakpoints": labelled(placed, self.layout, self.stable_kinds)}


class TurnPreparation:
    """Prepares each turn of a request as it is about to run (and again after a calibration retry)."""

    def __init__(self, settings: Settings, cache: ConversationCache, facts: ModelFacts, answerers: Answerers,
                 budget: HistoryBudget, compactor: Compactor, attachments: Attachments, images: Images,
                 clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.cache = cache
        self.facts = facts
        self.answerers = answerers  # what a model's answerer can take, and whether it keeps a session
        self.budget = budget
        self.calibration = budget.calibration
        self.planner = TurnPlanner(cache, compactor, attachments, settings.max_fork_depth, settings.history_step)
        self.images = images
        self.clock = clock

    async def prepare(self, state: RequestState, on_chunk: ChunkSink | None) -> Prepared:
        """The turn as it will be sent: its budget, the plan of what it sends within it (history,
        pinned exchanges, a summary standing in for what is left out, files), its messages and
        the provider call."""
        await self.facts.ready(state.model)
        memory = await self.cache.require(state.conversation_id)
        check_open(memory, self.clock())
        turn = self._turn_input(memory, state)
        budget = await self.budget.turn(state.model, turn.sent_system, turn.tokens, state.request.max_tokens)
        budget.check_fits()
        memory = await self.cache.widen(memory, budget.history)
        plan = await self.planner.plan(memory, budget, state.request.files)
        messages, own = await self._messages(state, turn, plan, budget)
        # the system prompt and the newest frozen summary: the prefix cache markers may close
        stable = stable_parts(turn.sent_system, plan.stand_in if own is None else None)
        call = self._call(state, memory, messages, turn.sent_system, stable, on_chunk)
        call.cache_root = plan.root
        return self._prepared(state, memory, turn, plan, own, call)

    def _turn_input(self, memory: ConversationMemory, state: RequestState) -> TurnInput:
        # messages added without a reply (or taken as the input, when they are what it sends)
        inputs = with_pending(memory.meta, records.input_lines(state), state.takes_pending)
        new_system = next((line["content"] for line in inputs if line["type"] == "system"), None)
        system = new_system if new_system is not None else memory.meta.system
        # instructions are this request's own system prompt; the conversation keeps its own
        instructions = state.request.instructions
        new_items = records.new_items(inputs)
        tokens = items_tokens(new_items, self.facts.count_tokens, MESSAGE_OVERHEAD)
        tokens += sum(self.images.part_tokens(part, state.model) for part in state.images)
        return TurnInput(inputs, new_items, tokens, new_system, system,
                         instructions if instructions is not None else system)

    async def _messages(self, state: RequestState, turn: TurnInput, plan: TurnPlan[Attached], budget: TurnBudget
                        ) -> tuple[list[dict[str, Any]], OwnHistory | None]:
        """The provider's messages: the plan's history (its images and PDFs sent again from storage)
        and the new input with the files block, or the client's own history when it sent one that fits."""
        history = plan.history
        if any(media_parts(exchange.input) for exchange in history.exchanges):
            abilities = await self.answerers.abilities(state.model)
            # a model known not to take a kind (the conversation moved to it) gets those parts' labels
            able = {"input_image": abilities.vision, "input_file": abilities.pdf_input}
            kinds = frozenset(kind for kind, known in able.items() if known is not False)
            history.exchanges = await self.images.replay(history.exchanges, kinds)
        tool_turns.check_called_in_history(history, turn.new_items, state.model)
        new_messages = await self.images.with_images(turn.new_items, plan.files.prepend(input_messages(turn.new_items)))
        own = own_history(state.request, budget.history - plan.files.tokens, self.facts.count_tokens)
        if own is not None:
            # the client's turns then the new input, so its calls and their outputs stay paired
            return build_messages(turn.sent_system, History(), [*own.messages, *new_messages]), own
        return build_messages(turn.sent_system, history, new_messages, plan.summary), None

    def _call(self, state: RequestState, memory: ConversationMemory, messages: list[dict[str, Any]],
              sent_system: str | None, stable: list[str], on_chunk: ChunkSink | None) -> ProviderCall:
        data = state.request
        options = data.provider_options()
        if data.extra_body:
            options["extra_body"] = data.extra_body
        return ProviderCall(
            model=state.model, messages=messages, temperature=data.temperature, max_tokens=data.max_tokens,
            timeout=data.timeout or self.settings.request_timeout, options=options, **data.tool_fields(),
            on_chunk=on_chunk, anthropic_beta=data.anthropic_beta,
            resume_session=self._resumable_session(memory, state.model, sent_system),
            request={"request_id": state.request_id, "response_id": state.response_id,
                     "conversation_id": state.conversation_id, "agent_id": state.agent_id,
                     "consortium": data.consortium},
            stable_system=stable,
        )

    def _prepared(self, state: RequestState, memory: ConversationMemory, turn: TurnInput, plan: TurnPlan[Attached],
                  own: OwnHistory | None, call: ProviderCall) -> Prepared:
        """The prepared turn with what its commit stores: the estimate calibration compares with
        the provider's count, the history's stats and the record of what was sent."""
        files, history, stand_in = plan.files, plan.history, plan.stand_in
        system_message = call.messages[0]
        estimate = ((own.tokens if own is not None else history.tokens) + files.tokens + turn.tokens
                    + (self.facts.count_tokens(system_message["content"]) + MESSAGE_OVERHEAD
                       if system_message["role"] == "system" else 0))
        ratio = self.calibration.ratio(state.model)
        stats: dict[str, Any] = {**history.stats(), **files.stats(), "prompt_tokens_estimate": round(estimate * ratio),
                 "calibration_ratio": round(ratio, 4)}
        if state.request.history:
            stats.update(own.stats() if own is not None else {"source": "stored"})
        if stand_in is not None and own is None:
            stats["summary_upto"] = stand_in.upto
            stats["summary_kinds"] = [block.kind for block in stand_in.blocks]
        sent = sent_record(history, [{"path": n.path, "status": n.status, "tokens": n.tokens} for n in files.notes],
                           stand_in.to_record() if stand_in is not None else None)
        if own is not None:
            sent["history_source"] = "client"  # the client's own turns went out, not the rebuild above
        if call.resume_session:
            sent["resumed_session"] = True  # the CLI holds the history; only the new input went out
        counts = ([(entry.n, len(x.chat_messages())) for entry, x in zip(history.entries, history.exchanges,
                                                                           strict=True)]
                  if own is None else [(None, len(own.messages))])
        kinds = ["system" if part == turn.sent_system else "summary" for part in call.stable_system]
        return Prepared(memory, call, turn.system, turn.new_system is not None, files.record_in(turn.inputs),
                        turn.new_items, turn.tokens, stats, files=files.new_files, estimate=estimate, sent=sent,
                        layout=layout(system_message["role"] == "system", counts, len(call.messages)),
                        stable_kinds=kinds)

    def _resumable_session(self, memory: ConversationMemory, model: str, system: str | None) -> str | None:
        """Resume a CLI session only when the previous exchange came from that same session, and
        under the same system prompt: a resumed session would never see a new one."""
        session = memory.meta.cli_session
        if not self.answerers.for_model(model).keeps_session or session is None:
            return None
        if session.model != model or session.n != memory.total or system != memory.meta.system:
            return None
        return session.session_id
