"""Preparing a turn: the token budget, the history within it (compaction's stand-in for what is
left out, pinned exchanges), calibration of the daemon's count, attachments and images, and the
provider call they make."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.items import Item, image_parts
from ksi_common.settings import Settings
from ksi_daemon.providers.base import ProviderCall
from ksi_daemon.providers.tool_calls import input_messages
from ksi_daemon.services.completion import exchange_records as records
from ksi_daemon.services.completion import tool_turns
from ksi_daemon.services.completion.admission import check_open
from ksi_daemon.services.completion.answerers import Answerers
from ksi_daemon.services.completion.attachments import Attachments
from ksi_daemon.services.completion.calibration import Calibration
from ksi_daemon.services.completion.client_history import own_history
from ksi_daemon.services.completion.compaction import Compactor
from ksi_daemon.services.completion.images import Images
from ksi_daemon.services.completion.requests import RequestState
from ksi_daemon.services.completion.stand_ins import stable_parts
from ksi_daemon.services.conversations.history import (
    MESSAGE_OVERHEAD,
    NOTE_RESERVE,
    History,
    Pinned,
    build_messages,
    pinned_exchanges,
    select_history,
    sent_record,
)
from ksi_daemon.services.conversations.memory import ConversationCache, ConversationMemory, items_tokens
from ksi_daemon.services.conversations.pending import with_pending
from ksi_daemon.storage.models import ConversationMeta

ChunkSink = Callable[[str | dict[str, Any]], None]  # a text piece, or a tool call's delta


class ModelFacts(Protocol):
    """What the completion path needs to know about models to budget a turn's tokens."""

    async def ready(self, model: str) -> None: ...

    def count_tokens(self, text: str) -> int: ...

    async def context_window(self, model: str) -> int: ...

    def output_reserve(self, model: str, max_tokens: int | None) -> int: ...


class HistoryBudget:
    """The tokens a turn's history may take: the model's window less the answer's reserve, the
    system prompt and the new input, in the daemon's count (the learned calibration ratio)."""

    def __init__(self, settings: Settings, facts: ModelFacts, calibration: Calibration) -> None:
        self.settings = settings
        self.facts = facts
        self.calibration = calibration

    async def history(self, model: str, system: str | None, input_tokens: int, max_tokens: int | None) -> int:
        """Tokens (as the daemon counts them) left for history in a turn of `model`.

        The window and the answer's reserve are the model's own tokens; dividing by the learned
        ratio turns them into the daemon's estimate, in which every stored count is kept.
        """
        window = await self.facts.context_window(model)
        reserve = self.facts.output_reserve(model, max_tokens)
        system_tokens = self.facts.count_tokens(system) + MESSAGE_OVERHEAD if system else 0
        usable = int((window - reserve) / self.calibration.ratio(model))
        return usable - system_tokens - input_tokens - NOTE_RESERVE

    async def pins(self, meta: ConversationMeta) -> int:
        """The tokens a conversation's pinned exchanges may take: their share of the history budget
        of a turn of its latest model with an empty input."""
        model = meta.models[-1] if meta.models else self.settings.default_model
        budget = await self.history(model, meta.system, 0, None)
        return max(0, int(budget * self.settings.pins_share))


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
        self.compactor = compactor
        self.attachments = attachments
        self.images = images
        self.clock = clock

    async def prepare(self, state: RequestState, on_chunk: ChunkSink | None) -> Prepared:
        """The turn as it will be sent: its new input, the history within the budget, the pinned
        exchanges, a summary standing in for what is left out, its files and images."""
        data = state.request
        await self.facts.ready(state.model)
        memory = await self.cache.require(state.conversation_id)
        check_open(memory, self.clock())
        # messages added without a reply (or taken as the input, when they are what it sends)
        inputs = with_pending(memory.meta, records.input_lines(state), state.takes_pending)
        new_system = next((line["content"] for line in inputs if line["type"] == "system"), None)
        system = new_system if new_system is not None else memory.meta.system
        # instructions are this request's own system prompt; the conversation keeps its own
        sent_system = data.instructions if data.instructions is not None else system
        new_items = records.new_items(inputs)
        count = self.facts.count_tokens
        input_tokens = items_tokens(new_items, count, MESSAGE_OVERHEAD)
        input_tokens += sum(self.images.tokens(part["image"], state.model) for part in state.images)
        budget = await self.budget.history(state.model, sent_system, input_tokens, data.max_tokens)
        if budget < 0:
            window = await self.facts.context_window(state.model)
            reserve = self.facts.output_reserve(state.model, data.max_tokens)
            raise KsiError(
                ErrorCode.CONTEXT_WINDOW_EXCEEDED,
                f"the new input needs about {-budget} tokens more than {state.model} allows "
                f"after reserving {reserve} for the answer",
                input_tokens=input_tokens, context_window=window, output_reserve=reserve,
                calibration_ratio=round(self.calibration.ratio(state.model), 4),
            )
        memory = await self.cache.widen(memory, budget)
        whole_budget = budget  # what the client's own history, when it sent one, must fit in
        pins_budget = int(budget * self.settings.pins_share)
        history = await select_history(self.cache, memory, budget, self.settings.max_fork_depth)
        stand_in = await self.compactor.for_turn(memory, state.model, budget) if history.omitted else None
        if stand_in is not None and stand_in.tokens < budget:
            # exchanges must be left out: summaries (or the fallback) stand in for 1..upto, history follows
            budget -= stand_in.tokens
            history = await select_history(self.cache, memory, budget, self.settings.max_fork_depth, stand_in.upto)
        else:
            stand_in = None  # compaction off (the note says what was left out), or too big to help
        after = stand_in.upto if stand_in is not None else 0
        # pinned exchanges the history left out (or a summary stands in for) take their share
        history, pinned = await self._with_pins(memory, history, budget, after, pins_budget, Pinned())
        budget -= pinned.tokens
        attached = await self.attachments.embed(history.exchanges, data.files,
                                                int(budget * self.settings.files_budget_share))
        if attached.tokens:  # files take their share first; history gets what they leave
            history = await select_history(self.cache, memory, budget - attached.tokens,
                                           self.settings.max_fork_depth, after)
            history, pinned = await self._with_pins(memory, history, budget - attached.tokens + pinned.tokens,
                                                    after, pins_budget, pinned)
            attached = attached.kept_for(history.exchanges)
        pinned.add_to(history, after)
        if any(image_parts(exchange.input) for exchange in history.exchanges):  # sent again, from storage
            vision = (await self.answerers.abilities(state.model)).vision
            history.exchanges = await self.images.replay(history.exchanges, vision)
        inputs = attached.record_in(inputs)
        tool_turns.check_called_in_history(history, new_items, state.model)
        new_messages = await self.images.with_images(new_items, attached.prepend(input_messages(new_items)))
        messages = build_messages(sent_system, history, new_messages,
                                  stand_in.text() if stand_in is not None else None)
        own = own_history(data, whole_budget - attached.tokens, count)  # the client's own, when it fits
        if own is not None:
            # the client's turns then the new input, so its calls and their outputs stay paired
            messages = build_messages(sent_system, History(), [*own.messages, *new_messages])
        # the prompt as the daemon counts it, for calibration against the provider's count
        estimate = ((own.tokens if own is not None else history.tokens) + attached.tokens + input_tokens
                    + (count(messages[0]["content"]) + MESSAGE_OVERHEAD if messages[0]["role"] == "system" else 0))
        stats = {**history.stats(), **attached.stats(),
                 "prompt_tokens_estimate": round(estimate * self.calibration.ratio(state.model)),
                 "calibration_ratio": round(self.calibration.ratio(state.model), 4)}
        if data.history:
            stats.update(own.stats() if own is not None else {"source": "stored"})
        if stand_in is not None and own is None:
            stats["summary_upto"] = stand_in.upto
            stats["summary_kinds"] = [block.kind for block in stand_in.blocks]
        options = data.provider_options()
        if data.extra_body:
            options["extra_body"] = data.extra_body
        call = ProviderCall(
            model=state.model, messages=messages, temperature=data.temperature, max_tokens=data.max_tokens,
            timeout=data.timeout or self.settings.request_timeout, options=options, **data.tool_fields(),
            on_chunk=on_chunk, anthropic_beta=data.anthropic_beta,
            resume_session=self._resumable_session(memory, state.model, sent_system),
            request={"request_id": state.request_id, "response_id": state.response_id,
                     "conversation_id": state.conversation_id, "agent_id": state.agent_id,
                     "consortium": data.consortium},
            stable_system=stable_parts(sent_system, stand_in if own is None else None),
        )
        sent = sent_record(history, [{"path": n.path, "status": n.status, "tokens": n.tokens} for n in attached.notes],
                           stand_in.to_record() if stand_in is not None else None)
        if own is not None:
            sent["history_source"] = "client"  # the client's own turns went out, not the rebuild above
        if call.resume_session:
            sent["resumed_session"] = True  # the CLI holds the history; only the new input went out
        return Prepared(memory, call, system, new_system is not None, inputs, new_items, input_tokens,
                        stats, files=attached.new_files, estimate=estimate, sent=sent)

    async def _with_pins(self, memory: ConversationMemory, history: History, budget: int, after: int,
                         pins_budget: int, pinned: Pinned) -> tuple[History, Pinned]:
        """`history` (selected within `budget` less `pinned`'s tokens) and the pinned exchanges it
        leaves out, within `pins_budget`: a pin the history shows anyway costs nothing more. Room
        made for a pin may push out another, older one, pinned in turn (a few rounds at most)."""
        if not memory.meta.pins or not (history.omitted or after):
            return history, pinned
        for _ in range(len(memory.meta.pins)):
            taken = {e.n for e in history.entries} | {e.n for e in pinned.entries}
            more = await pinned_exchanges(self.cache, memory, pins_budget - pinned.tokens,
                                          self.settings.max_fork_depth, taken)
            if not more.entries:
                break
            pinned.merge(more)
            history = await select_history(self.cache, memory, budget - pinned.tokens,
                                           self.settings.max_fork_depth, after)
        return history, pinned

    def _resumable_session(self, memory: ConversationMemory, model: str, system: str | None) -> str | None:
        """Resume a CLI session only when the previous exchange came from that same session, and
        under the same system prompt: a resumed session would never see a new one."""
        session = memory.meta.cli_session
        if not self.answerers.for_model(model).keeps_session or session is None:
            return None
        if session.model != model or session.n != memory.total or system != memory.meta.system:
            return None
        return session.session_id
