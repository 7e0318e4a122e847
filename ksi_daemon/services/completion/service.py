"""`completion:*` events: queue requests per conversation, rebuild history, call the model,
log and index the exchange, and emit the outcome."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import structlog

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.ids import new_id, new_response_id
from ksi_common.items import Item, image_parts
from ksi_common.records import IndexEntry
from ksi_common.settings import Settings
from ksi_common.timefmt import format_ts, parse_ts
from ksi_daemon.context import EventContext
from ksi_daemon.events import NoData
from ksi_daemon.providers.options import check_options, circuit_key, is_routing_option
from ksi_daemon.providers.base import (
    ModelAbilities,
    Provider,
    ProviderCall,
    ProviderFailure,
    ProviderReply,
)
from ksi_daemon.router import Router, Unregister
from ksi_daemon.services.completion import exchange_records as records
from ksi_daemon.services.completion.activity import CompletionActivity
from ksi_daemon.services.completion.attachments import Attachments
from ksi_daemon.services.completion.images import CheckedImage, Images
from ksi_daemon.services.completion.client_history import ClientHistory, own_history
from ksi_daemon.services.completion.handover import adopted_state, request_record
from ksi_daemon.services.completion.recovery import indexed_result, recover
from ksi_daemon.services.completion.models import (
    CompletionAsync,
    CompletionCancel,
    CompletionStatus,
    CompletionWait,
)
from ksi_daemon.services.completion.calibration import Calibration, NoCalibrationStore
from ksi_daemon.services.completion.compaction import Compactor, NoSummaries
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
from ksi_daemon.services.conversations.digests import next_digest
from ksi_daemon.services.conversations.memory import ConversationCache, ConversationMemory, Exchange, items_tokens
from ksi_daemon.services.conversations.pending import with_pending, without_consumed
from ksi_daemon.services.completion import tool_turns
from ksi_daemon.providers.tool_calls import input_messages
from ksi_daemon.services.conversations.responses import locate
from ksi_daemon.services.completion.requests import FINISHED, FinishedRequest, RequestRegistry, RequestState
from ksi_daemon.services.cancellation import to_the_end
from ksi_daemon.services.resilience import CircuitBreaker, RetryPolicy, with_retries
from ksi_daemon.services.completion.scheduler import Job, Scheduler
from ksi_daemon.services.completion.streams import ChunkLogs, CompletionChunks
from ksi_daemon.services.limits import ConcurrencyLimits
from ksi_daemon.services.requests_elsewhere import RequestsElsewhere
from ksi_daemon.storage.models import ConversationMeta
from ksi_daemon.storage.ports import (
    ConversationExists,
    ConversationLeases,
    ExchangeConflict,
    OneDaemonRequests,
    PoolRequest,
    RequestJournal,
    ResponseStore,
    SummaryStore,
)

log = structlog.get_logger("ksi.completion")

HANDED_OVER = "handed_over"  # a request another daemon of the pool took over while this one was silent
INLINE_CONSORTIUM = "consortium/inline"  # the model of a request carrying its own consortium definition

CLI_PREFIXES = ("claude-cli/", "gemini-cli/")
CALIBRATION_SAVE_INTERVAL = 5.0  # seconds: a crash loses at most this much learning
BUILTIN_MODEL = "echo/demo"  # the built-in echo provider answers every `echo/...` name


class ModelFacts(Protocol):
    """What the service needs to know about models to budget tokens."""

    async def ready(self, model: str) -> None: ...

    def count_tokens(self, text: str) -> int: ...

    async def context_window(self, model: str) -> int: ...

    def output_reserve(self, model: str, max_tokens: int | None) -> int: ...

    async def check_request(self, model: str, options: dict[str, Any]) -> None:
        """Refuse options the model is known not to follow (a JSON schema it cannot keep to)."""

    async def abilities(self, model: str) -> ModelAbilities: ...

    async def check_tools(self, model: str) -> None:
        """Refuse tools for a model known not to call them."""


@dataclass(slots=True)
class AgentDefaults:
    conversation_id: str
    system: str | None = None
    model: str | None = None
    temperature: float | None = None
    options: dict[str, Any] = field(default_factory=dict)


class AgentDirectory(Protocol):
    """Where the completion service finds an agent's defaults (the agents' registry)."""

    async def defaults(self, agent_id: str) -> AgentDefaults: ...


class NoAgents:
    """The agent directory of a daemon without agents: every id is unknown."""

    async def defaults(self, agent_id: str) -> AgentDefaults:
        raise KsiError(ErrorCode.AGENT_NOT_FOUND, f"no agent {agent_id}", agent_id=agent_id)


@runtime_checkable
class ChecksUpFront(Protocol):
    """An answerer that can refuse a model before the request is queued (an unknown consortium,
    a model name no provider answers to)."""

    async def check(self, model: str, inline: dict[str, Any] | None) -> None: ...


@dataclass(slots=True)
class _Admission:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


@dataclass(slots=True)
class Prepared:
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


class CompletionService:
    def __init__(
        self,
        settings: Settings,
        router: Router,
        cache: ConversationCache,
        responses: ResponseStore,
        journal: RequestJournal,
        provider: Provider,
        facts: ModelFacts,
        images: Images,
        answerers: dict[str, Provider] | None = None,
        clock: Callable[[], float] = time.time,
        calibration: Calibration | None = None,
        summaries: SummaryStore | None = None,
        agents: AgentDirectory | None = None,
        limits: ConcurrencyLimits | None = None,
        leases: ConversationLeases | None = None,
        elsewhere: RequestsElsewhere | None = None,
    ) -> None:
        self.settings = settings
        self.router = router
        self.cache = cache
        self.responses = responses
        self.journal = journal
        self.provider = provider
        self.facts = facts
        self.answerers = answerers or {}  # model prefix -> answerer (e.g. "consortium/")
        # found once: an isinstance check against a Protocol costs tens of microseconds per request
        self._up_front = {id(a): a for a in [provider, *self.answerers.values()] if isinstance(a, ChecksUpFront)}
        self.agents: AgentDirectory = agents or NoAgents()
        self.elsewhere = elsewhere or RequestsElsewhere(OneDaemonRequests(), self.cache.store, responses)
        self.clock = clock
        self.attachments = Attachments(settings.allowed_file_roots, facts.count_tokens)
        self.images = images
        self.requests = RequestRegistry(settings.finished_requests_kept)
        self.streams = ChunkLogs()  # the chunks of background requests, readable again
        self.activity = CompletionActivity()
        # one limits object with the consortium: its member calls count against the same limits;
        # a job answered by an answerer (a consortium run) takes no slot itself, its calls do
        self.limits = limits or ConcurrencyLimits(settings.max_concurrency,
                                                  lambda m: settings.model_settings(m).max_concurrency)
        self.scheduler = Scheduler(self.limits, takes_slot=lambda model: self._answerer(model) is self.provider,
                                   leases=leases, offers=self.elsewhere.requests)
        self.retry = RetryPolicy(settings.retry_attempts, settings.retry_base_delay, settings.retry_max_delay)
        self.breaker = CircuitBreaker(settings.circuit_failures, settings.circuit_reset)
        self._overload_logged_at = -1.0e9
        self._held: dict[str, ConversationMemory] = {}  # request id -> the conversation it keeps in memory
        self._admitting: dict[str, _Admission] = {}  # conversation (or agent) id -> its admission turn
        self._history_admission = asyncio.Lock()  # see submit
        self.calibration = calibration or Calibration(NoCalibrationStore(), enabled=False)
        self.compactor = Compactor(settings, router, cache, summaries or NoSummaries(), provider,
                                   facts.count_tokens, self.history_budget)
        self._calibration_saved = time.monotonic()
        self._background: set[asyncio.Task[None]] = set()  # calibration saves, discards under way
        self.client_history = ClientHistory(cache, responses, router, self.requests.count_live, self._can_continue,
                                            settings.max_fork_depth)

    def register(self) -> list[Unregister]:
        r = self.router
        return [*self.compactor.register(),
            r.emits("completion:result", "completion:error", "completion:cancelled", "completion:chunk"),
            r.register("completion:async", self.handle_async, CompletionAsync,
                       "Queue a completion in a conversation; the outcome is emitted as completion:result."),
            r.register("completion:wait", self.handle_wait, CompletionWait,
                       "Wait for a request's result, up to a timeout."),
            r.register("completion:status", self.handle_status, CompletionStatus,
                       "State of a request: queued, running, done, failed or cancelled."),
            r.register("completion:cancel", self.handle_cancel, CompletionCancel,
                       "Cancel a queued or running request."),
            r.register("completion:chunks", self.handle_chunks, CompletionChunks,
                       "A background request's chunks after an index, its status and, once ended, its outcome."),
            r.register("completion:models", self.handle_models, NoData,
                       "Models to offer by name: the default, those configured by exact name, the built-in echo."),
        ]

    async def start(self) -> None:
        for record in await recover(self.journal, self.cache.store, self.responses):
            if record.get("code") == ErrorCode.DAEMON_RESTART and await self.elsewhere.knows(record["request_id"]):
                # accepted is durable for the pool: a live daemon (this one, once the old run's
                # heartbeat is stale) takes it over, so it is answered from there, never as lost
                continue
            self.requests.add_interrupted(record)
        await self.calibration.load()

    async def stop(self, timeout: float) -> None:
        await self.scheduler.stop(timeout)
        await self.compactor.stop(timeout)
        await self.journal.close()
        await self.calibration.save()

    def _save_calibration_now_and_then(self) -> None:
        """Learned ratios reach storage at most every few seconds, in the background (and at stop)."""
        now = time.monotonic()
        if self.calibration.dirty and now - self._calibration_saved > CALIBRATION_SAVE_INTERVAL:
            self._calibration_saved = now
            task = asyncio.get_running_loop().create_task(self.calibration.save())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def health(self) -> dict[str, Any]:
        return {
            "queued": self.scheduler.queued - self.scheduler.running,
            "running": self.scheduler.running,
            "active_conversations": self.scheduler.active_conversations,
            "conversations_in_memory": len(self.cache),
            "circuits": self.breaker.report(),
            "compaction": self.compactor.health(),
            "models": self._per_model(),
            **self.activity.report(),
        }

    def _per_model(self) -> dict[str, dict[str, int]]:
        """Queued and running requests of each model: what a console shows as in flight."""
        counts: dict[str, dict[str, int]] = {}
        for state in self.requests.live():
            slot = counts.setdefault(state.model, {"queued": 0, "running": 0})
            if state.status in slot:
                slot[state.status] += 1
        return counts

    # -- events -------------------------------------------------------------
    async def handle_async(self, data: CompletionAsync, context: EventContext) -> dict[str, Any]:
        state = await self.submit(data, context)
        return {
            "request_id": state.request_id,
            "conversation_id": state.conversation_id,
            "status": state.status,
            "queue_position": self.scheduler.position(state.job) if state.job else 0,
            "response_id": state.response_id,
            "model": state.model,
        }

    async def handle_wait(self, data: CompletionWait, _context: EventContext) -> dict[str, Any]:
        found = self.requests.find(data.request_id)
        if found is None:  # accepted by another daemon of the pool (or by none)
            return await self.elsewhere.wait(data.request_id, data.timeout)
        if isinstance(found, RequestState) and not found.done.is_set() and data.timeout > 0:
            try:
                async with asyncio.timeout(data.timeout):  # no task of its own, as wait_for makes
                    await found.done.wait()
            except TimeoutError:
                pass
        if isinstance(found, RequestState) and found.status == HANDED_OVER:  # another daemon runs it now
            return await self.elsewhere.wait(data.request_id, data.timeout)
        if isinstance(found, dict) and found.get("status") == "done" and not found.get("result"):
            # done before the last restart: its result is rebuilt from storage when first asked for
            found["result"] = await indexed_result(found, self.cache.store, self.responses)
        return self.outcome(found)

    async def handle_status(self, data: CompletionStatus, _context: EventContext) -> dict[str, Any]:
        found = self.requests.find(data.request_id)
        if found is None:  # accepted by another daemon of the pool (or by none)
            return await self.elsewhere.status(data.request_id)
        return self.describe(found)

    async def handle_cancel(self, data: CompletionCancel, _context: EventContext) -> dict[str, Any]:
        found = self.requests.find(data.request_id)
        if found is None:  # accepted by another daemon of the pool (or by none): asked to cancel it
            return await self.elsewhere.cancel(data.request_id)
        if isinstance(found, RequestState) and found.job is not None and found.status not in FINISHED:
            self.scheduler.cancel(found.job)
            if found.status == "running":
                await found.done.wait()
            return {**self.describe(found), "cancelled": found.status == "cancelled"}
        return {**self.describe(found), "cancelled": False}

    async def handle_chunks(self, data: CompletionChunks, _context: EventContext) -> dict[str, Any]:
        return await self.streams.read(data)

    async def handle_models(self, _data: NoData, _context: EventContext) -> dict[str, Any]:
        # Any model litellm reaches is served; these are the names worth offering to a picker.
        # Configured patterns (`openai/*`) name no model, so only exact names are listed.
        configured = [name for name in self.settings.models if not any(c in name for c in "*?[")]
        names = list(dict.fromkeys([self.settings.default_model, *configured, BUILTIN_MODEL]))
        return {"default": self.settings.default_model, "models": names}

    def outcome(self, found: RequestState | FinishedRequest | dict[str, Any]) -> dict[str, Any]:
        """Result data when done; a failure for failed or cancelled; else the status."""
        if isinstance(found, dict):  # a request of the previous daemon, finished or left unfinished
            if found.get("status") == "done":
                # indexed just before a crash: its result was rebuilt; else the status names its response
                return found.get("result") or self.describe(found)
            code = found.get("code", ErrorCode.DAEMON_RESTART)
            message = ("the request was interrupted by a daemon restart" if code == ErrorCode.DAEMON_RESTART
                       else f"the request ended {found.get('status')} ({code}) before the daemon restarted")
            raise KsiError(code, message, request_id=found["request_id"])
        if found.status == "done" and found.result is not None:
            return found.result
        if found.status in ("failed", "cancelled") and found.error is not None:
            raise KsiError(found.error.code, found.error.message,
                           **{**found.error.details, "request_id": found.request_id})
        return self.describe(found)

    def describe(self, found: RequestState | FinishedRequest | dict[str, Any]) -> dict[str, Any]:
        if isinstance(found, dict):
            if found.get("status") == "done":
                return {"request_id": found["request_id"], "conversation_id": found.get("conversation_id"),
                        "status": "done", "response_id": found.get("response_id"), "queue_position": 0,
                        "recovered": True}
            return {"request_id": found["request_id"], "conversation_id": found.get("conversation_id"),
                    "status": "cancelled" if found.get("status") == "cancelled" else "failed",
                    "reason": found.get("code", "daemon_restart"), "queue_position": 0}
        position = 0
        if isinstance(found, RequestState) and found.job is not None and found.status == "queued":
            position = self.scheduler.position(found.job)
        started = found.started if isinstance(found, FinishedRequest) else found.started_at is not None
        description: dict[str, Any] = {
            "request_id": found.request_id,
            "conversation_id": found.conversation_id,
            "status": found.status,
            "queue_position": position,
            "created": found.created,
            "model": found.model,
        }
        if found.response_id and started:  # a request that never ran has no response
            description["response_id"] = found.response_id
        if found.error is not None:
            description["reason"] = found.error.code
        return description

    # -- submission ---------------------------------------------------------
    async def submit(self, data: CompletionAsync, context: EventContext, *, from_agent: str | None = None) -> RequestState:
        """Validate a request against its conversation and queue it; raises on bad input.

        Requests naming one conversation are admitted one at a time, in arrival order: loading a
        cold conversation or creating a new one suspends, and a later request must not overtake
        an earlier one (or create the same conversation a second time) meanwhile.
        """
        if data.history:
            # one client-held history at a time, from matching it to admitting its request: two
            # identical ones sent at once must not both continue the same conversation in place
            # (the second sees the first admitted there, and forks)
            async with self._history_admission:
                # an agent's profile supplies the system prompt its client never sees, so never resends
                agent_system = (await self.agents.defaults(data.agent_id)).system if data.agent_id else None
                data = await self.client_history.resolve(data, context, self._check_before_write, agent_system)
                return await self._submit(data, context, from_agent)
        return await self._submit(data, context, from_agent)

    async def _submit(self, data: CompletionAsync, context: EventContext, from_agent: str | None) -> RequestState:
        if data.previous_response_id is not None:
            data = await self._continue_after(data, context)
        key = data.conversation_id or data.agent_id
        if key is None:
            return await self._admit(data, context, from_agent)
        admission = self._admitting.get(key)
        if admission is None:
            admission = self._admitting[key] = _Admission()
        admission.users += 1
        try:
            async with admission.lock:
                return await self._admit(data, context, from_agent)
        finally:
            admission.users -= 1
            if not admission.users:
                self._admitting.pop(key, None)

    async def _continue_after(self, data: CompletionAsync, context: EventContext) -> CompletionAsync:
        """The request continuing the conversation of `previous_response_id`: in that conversation
        when the response is its newest exchange and nothing else is queued there (so nothing can
        come between), else in a fork at that exchange (copy-free, as conversation:fork makes it)."""
        assert data.previous_response_id is not None
        found = await locate(self.cache, self.responses, data.previous_response_id,
                             ErrorCode.PREVIOUS_RESPONSE_NOT_FOUND)
        if found.memory is None or found.n is None:
            raise KsiError(ErrorCode.PREVIOUS_RESPONSE_NOT_FOUND,
                           f"response {data.previous_response_id} is in no conversation's history (it failed, "
                           "or its conversation was deleted)", response_id=data.previous_response_id)
        conversation_id = found.memory.conversation_id
        if not found.newest or self.requests.count_live(conversation_id):
            fork_data: dict[str, Any] = {"conversation_id": conversation_id, "at": found.n}
            if data.origin is not None:
                fork_data["origin"] = data.origin
            fork = await self.router.request("conversation:fork", fork_data, context.child())
            conversation_id = fork["conversation_id"]
        return data.model_copy(update={"conversation_id": conversation_id, "previous_response_id": None})

    async def _admit(self, data: CompletionAsync, context: EventContext, from_agent: str | None) -> RequestState:
        self._check_capacity()  # refuse before any work is done or any conversation is written
        images: list[CheckedImage] = []
        if data.files:  # refused files fail the ack before any conversation is written
            files, images = await self.images.split_files(data.files)  # images are read here, once
            data = data.model_copy(update={"files": await self.attachments.check(files)})
        for field, part in data.image_parts():  # an https URL is kept as it is, never fetched
            images.append(await self.images.check(part, field))
        agent = await self.agents.defaults(data.agent_id) if data.agent_id else None
        chosen = data.model or (INLINE_CONSORTIUM if data.consortium else None) or (agent.model if agent else None)
        conversation_id = data.conversation_id or (agent.conversation_id if agent else None)
        if chosen is not None or conversation_id is None:  # before a new conversation is written
            await self._check_answerer(chosen or self.settings.default_model, data)
            await self._check_model_options(chosen or self.settings.default_model, data, images)
        await tool_turns.check_new_conversation(self.cache, conversation_id, data)
        memory = await self._conversation_for(conversation_id, data, agent, chosen)
        self._check_open(memory)
        await tool_turns.check_turn(self.cache, memory, data, self.settings.max_fork_depth)
        if memory.meta.turn_cap is not None:
            pending = self.requests.count_live(memory.conversation_id)
            if memory.total + pending >= memory.meta.turn_cap:
                raise KsiError(ErrorCode.CONVERSATION_FULL,
                               f"conversation {memory.conversation_id} reached its cap of {memory.meta.turn_cap} exchanges",
                               conversation_id=memory.conversation_id, turn_cap=memory.meta.turn_cap)
        model = chosen or self._last_model(memory) or self.settings.default_model
        if chosen is None and conversation_id is not None:
            await self._check_answerer(model, data)
            await self._check_model_options(model, data, images)
        self._check_options(model, data)
        if (agent is not None and agent.system and memory.conversation_id != agent.conversation_id
                and data.system is None and data.instructions is None):
            # an agent joining another conversation speaks under its own profile's system prompt, for its
            # turn only: the conversation keeps its own (as `instructions` does)
            data = data.model_copy(update={"instructions": agent.system})
        self._check_admissible(memory)  # a request refused here stores no image
        if images:
            stored_images = [await self.images.store(image) for image in images]
            self._check_admissible(memory)  # again: the store awaited; no await from here on
        else:
            stored_images = []
        state = RequestState(
            request_id=new_id("req-"), conversation_id=memory.conversation_id, model=model,
            request=data, context=context, agent_id=data.agent_id or context.agent_id, from_agent=from_agent,
            # known from the ack on, so a client can name the response before it exists (a stream's first event)
            response_id=new_response_id(model), made_conversation=conversation_id is None, images=stored_images,
        )
        state.job = Job(key=memory.conversation_id, model=model, run=lambda: self._run(state),
                        on_cancel_queued=lambda: self._cancelled_in_queue(state), ticket=state.request_id,
                        on_taken_over=lambda: self._handed_over(state))
        self.requests.add(state)
        if data.background:
            self.streams.open(state)
        memory.users += 1  # held in memory until the request ends (see ConversationCache._keep)
        self._held[state.request_id] = memory
        # two lines a request, queued and its end: the response id is known from here, so a
        # restart finds an exchange indexed before the kill without a `running` line
        self.journal.record(state.request_id, state.conversation_id, "queued", response_id=state.response_id)
        try:  # the pool's order, and the request durable for the pool, before the ack leaves
            await self.scheduler.line_up(state.job, request_record(state))
        except KsiError as error:
            self._finish(state, "failed", error=error)
            raise
        self.scheduler.submit(state.job)
        return state

    def _check_admissible(self, memory: ConversationMemory) -> None:
        self._check_capacity()  # again: other requests may have been queued while this one waited
        if memory.retired:  # discarded (or deleted) while this request waited
            raise KsiError(ErrorCode.CONVERSATION_NOT_FOUND, f"conversation {memory.conversation_id} does not exist",
                           conversation_id=memory.conversation_id)

    def _check_capacity(self) -> None:
        if self.scheduler.queued >= self.settings.max_queued:
            now = time.monotonic()
            if now - self._overload_logged_at >= 1.0:  # once a second: an overload must not flood the log
                self._overload_logged_at = now
                log.warning("overloaded", code=ErrorCode.OVERLOADED, queued=self.scheduler.queued,
                            limit=self.settings.max_queued)
            raise KsiError(ErrorCode.OVERLOADED, "too many queued requests; retry later",
                           retry_after=1.0, queued=self.scheduler.queued)

    async def _check_model_options(self, model: str, data: CompletionAsync, images: list[CheckedImage]) -> None:
        if self._answerer(model) is not self.provider:
            self.images.check_consortium(model, [image.field for image in images])
            tool_turns.refuse_tools_to(model, data, "is a consortium: its members answer, and no tool call reaches the client")
            return
        options = data.provider_options()
        if options:
            await self.facts.check_request(model, options)
        if data.tools:
            await self.facts.check_tools(model)
        if images:
            self.images.check_model(model, await self.facts.abilities(model), [image.field for image in images])

    def _check_options(self, model: str, data: CompletionAsync) -> None:
        check_options(model, data.options, self.settings.model_settings(model).allow_options)

    async def _conversation_for(self, conversation_id: str | None, data: CompletionAsync,
                                agent: AgentDefaults | None, chosen: str | None) -> ConversationMemory:
        if any(is_routing_option(name) for name in data.options) and (
                conversation_id is None or self.cache.cached(conversation_id) is None):
            # a new conversation answers with the chosen or the default model: refuse its options
            # before anything is written (an existing one is checked against its own last model)
            if conversation_id is None or not await self.cache.store.exists(conversation_id):
                self._check_options(chosen or self.settings.default_model, data)
        # Another tool's id for this conversation (llm's, say) is kept in its metadata, so the link
        # survives restarts of both and any door can show it.
        extra = {"external_ids": dict(data.external_ids)} if data.external_ids else None
        # the preview is recorded with the creation, so the first exchange's metadata differs from
        # it only in its totals (which the JSONL store saves lazily) and costs no extra write
        if conversation_id is None:
            return await self.create_conversation(new_id("conv-"), for_request=True, agent_id=data.agent_id,
                                                  system=agent.system if agent else None, extra=extra,
                                                  origin=data.origin, preview=records.first_input_preview(data))
        memory = await self.cache.get(conversation_id)
        if memory is not None and not memory.retired:  # a retired one is being discarded: gone
            return memory
        own_agent_conversation = agent is not None and conversation_id == agent.conversation_id
        if not (data.create or own_agent_conversation):
            raise KsiError(ErrorCode.CONVERSATION_NOT_FOUND, f"conversation {conversation_id} does not exist",
                           conversation_id=conversation_id)
        try:
            return await self.create_conversation(conversation_id, for_request=True, agent_id=data.agent_id,
                                                  system=agent.system if agent else None, extra=extra,
                                                  origin=data.origin, preview=records.first_input_preview(data))
        except ConversationExists:  # another daemon created it meanwhile: continue it
            return await self.cache.require(conversation_id)

    async def create_conversation(self, conversation_id: str, *, for_request: bool = False,
                                  **fields: Any) -> ConversationMemory:
        """A new conversation (exclusive: raises `ConversationExists` when the id is taken);
        `for_request`: created for a request, durable with its first exchange."""
        now = format_ts(self.clock())
        meta = ConversationMeta(conversation_id=conversation_id, ttl=self.settings.default_ttl,
                                created=now, last_activity=now,
                                **{k: v for k, v in fields.items() if v is not None})
        await self.cache.store.create(meta, durable_with_first_exchange=for_request)
        return self.cache.create(meta)

    async def _check_before_write(self, data: CompletionAsync) -> None:
        """What `_admit` refuses before a new conversation is written, for one written for a history."""
        self._check_capacity()
        model = data.model or (INLINE_CONSORTIUM if data.consortium else None) or self.settings.default_model
        await self._check_answerer(model, data)
        await self._check_model_options(model, data, [])  # the request's images are checked at its admission
        self._check_options(model, data)

    def _can_continue(self, memory: ConversationMemory) -> bool:
        """Not archived, not expired, not full: a request may be appended to it."""
        try:
            self._check_open(memory)
        except KsiError:
            return False
        cap = memory.meta.turn_cap
        return cap is None or memory.total + self.requests.count_live(memory.conversation_id) < cap

    def _check_open(self, memory: ConversationMemory) -> None:
        meta = memory.meta
        if meta.status == "archived":
            raise KsiError(ErrorCode.CONVERSATION_ARCHIVED,
                           f"conversation {meta.conversation_id} is archived; set it active to continue",
                           conversation_id=meta.conversation_id)
        if meta.ttl is not None and parse_ts(meta.last_activity) + meta.ttl < self.clock():
            raise KsiError(ErrorCode.CONVERSATION_EXPIRED, f"conversation {meta.conversation_id} expired",
                           conversation_id=meta.conversation_id,
                           expired_at=format_ts(parse_ts(meta.last_activity) + meta.ttl))

    @staticmethod
    def _last_model(memory: ConversationMemory) -> str | None:
        # an inline consortium cannot answer again without its definition: the turn after one
        # goes to the model used before it (or the default)
        return next((m for m in reversed(memory.meta.models) if m != INLINE_CONSORTIUM), None)

    async def cancel_conversation(self, conversation_id: str, timeout: float = 10.0) -> int:
        """Cancel every queued or running request of a conversation and wait until they ended."""
        states = [s for s in self.requests.live() if s.conversation_id == conversation_id]
        memory = self.cache.cached(conversation_id)
        committing = memory is not None and memory.lock.locked()
        for state in states:
            if state.job is None or state.status in FINISHED:
                continue
            if state.status == "running" and committing:
                continue  # its exchange is being written: cancelling now would tear it; let it finish
            self.scheduler.cancel(state.job)
        if states:
            await asyncio.wait([asyncio.ensure_future(s.done.wait()) for s in states], timeout=timeout)
        return len(states)

    def _cancelled_in_queue(self, state: RequestState) -> None:
        error = KsiError(ErrorCode.CANCELLED, "cancelled while queued", request_id=state.request_id)
        memory = self._held.get(state.request_id)
        self._finish(state, "cancelled", error=error)
        if state.made_conversation and memory is not None:  # the empty conversation made for it goes too
            task = asyncio.get_running_loop().create_task(self._discard_if_unused(state, memory))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    # -- the pool: requests another daemon accepted and can no longer run ----
    async def adopt(self, taken: PoolRequest) -> None:
        """Run a request of a daemon that died, as it would have (same ids), or, when its exchange
        was indexed before it died, report it done from storage without running it again."""
        state = adopted_state(taken.record)
        if taken.indexed:
            line = {"request_id": state.request_id, "response_id": state.response_id,
                    "conversation_id": state.conversation_id}
            result = await indexed_result(line, self.cache.store, self.responses)
            self.requests.add_interrupted({**line, "status": "done", "recovered": True, "result": result})
            self.journal.record(state.request_id, state.conversation_id, "done", response_id=state.response_id)
            if result is not None:
                self.router.emit("completion:result", result, state.context.child())
            return
        memory = await self.cache.require(state.conversation_id)
        state.job = Job(key=memory.conversation_id, model=state.model, run=lambda: self._run(state),
                        on_cancel_queued=lambda: self._cancelled_in_queue(state), ticket=state.request_id,
                        on_taken_over=lambda: self._handed_over(state))
        self.requests.add(state)
        memory.users += 1
        self._held[state.request_id] = memory
        self.journal.record(state.request_id, state.conversation_id, "queued", response_id=state.response_id)
        await self.scheduler.line_up(state.job, taken.record)  # its new ticket is this daemon's
        self.scheduler.submit(state.job)

    def _handed_over(self, state: RequestState) -> None:
        """Taken over by another daemon while this one was silent: that daemon runs it and answers
        for it; waiters here are sent there. Nothing is logged under its response id here."""
        held = self._held.pop(state.request_id, None)
        if held is not None:
            held.users -= 1
        state.status = HANDED_OVER
        self.requests.forget(state.request_id)
        state.done.set()
        log.warning("request_handed_over", request_id=state.request_id, conversation_id=state.conversation_id)

    # -- running ------------------------------------------------------------
    async def _run(self, state: RequestState) -> None:
        state.status = "running"
        state.started_at = time.perf_counter()
        attempts: list[dict[str, Any]] = []
        inputs = records.input_lines(state)
        try:
            prepared = await self._prepare(state)
            inputs = prepared.inputs
            answerer = self._answerer(state.model)
            try:
                reply = await self._call(state, answerer, prepared, attempts)
            except KsiError as error:
                if error.code != ErrorCode.CONTEXT_WINDOW_EXCEEDED or not self.calibration.enabled:
                    raise
                # the model counts more tokens than we thought: count more strictly, retry once
                self.calibration.tighten(state.model)
                prepared = await self._prepare(state)
                inputs = prepared.inputs
                reply = await self._call(state, answerer, prepared, attempts)
            async with prepared.memory.lock:  # conversation:update/delete change metadata under it too
                result = await self._commit(state, prepared, reply, attempts)
        except asyncio.CancelledError:
            error = KsiError(ErrorCode.CANCELLED, "cancelled while running", request_id=state.request_id)
            await self._log_failure(state, inputs, error, attempts)
            await self._discard_if_unused(state, self._held.get(state.request_id))
            self._finish(state, "cancelled", error=error)
            return
        except KsiError as error:
            if error.code == ErrorCode.LEASE_LOST and await self.elsewhere.taken_from_here(state.request_id):
                self._handed_over(state)  # the daemon that took it over runs it again, under the same ids
                return
            await self._log_failure(state, inputs, error, attempts)
            await self._discard_if_unused(state, self._held.get(state.request_id))
            self._finish(state, "failed", error=error)
            return
        except Exception as exc:
            log.exception("completion_failed", request_id=state.request_id)
            error = KsiError(ErrorCode.INTERNAL_ERROR, f"internal error: {type(exc).__name__}")
            await self._log_failure(state, inputs, error, attempts)
            await self._discard_if_unused(state, self._held.get(state.request_id))
            self._finish(state, "failed", error=error)
            return
        self._finish(state, "done", result=result)

    async def _call(self, state: RequestState, answerer: Provider, prepared: Prepared,
                    attempts: list[dict[str, Any]]) -> ProviderReply:
        reply = await with_retries(lambda: self._attempt(answerer, prepared.call),
                                   self.retry, self.breaker, self._circuit_key(state.model, prepared.call.options), attempts,
                                   log_fields={"request_id": state.request_id, "conversation_id": state.conversation_id,
                                               "model": state.model})
        if answerer is self.provider and prepared.call.resume_session is None:
            # a resumed CLI session or a consortium counts a prompt we never built: nothing to learn
            self.calibration.observe(state.model, prepared.estimate, reply.usage.get("prompt_tokens", 0))
            self._save_calibration_now_and_then()
        return reply

    async def _check_answerer(self, model: str, data: CompletionAsync) -> None:
        """Answerers that can refuse a model up front (an unknown consortium) fail the ack itself."""
        checker = self._up_front.get(id(self._answerer(model)))
        if checker is not None:
            await checker.check(model, data.consortium)

    def _answerer(self, model: str) -> Provider:
        for prefix, answerer in self.answerers.items():
            if model.startswith(prefix):
                return answerer
        return self.provider

    def _circuit_key(self, model: str, options: dict[str, Any]) -> str:
        return circuit_key(model, self.settings.model_settings(model).api_base, options)

    async def _attempt(self, answerer: Provider, call: ProviderCall) -> ProviderReply:
        timeout = call.timeout or self.settings.request_timeout
        try:
            async with asyncio.timeout(timeout):  # no task of its own, as wait_for makes
                return await answerer.complete(call)
        except TimeoutError:
            raise ProviderFailure(ErrorCode.TIMEOUT, f"no answer within {timeout}s", retryable=True) from None

    async def _prepare(self, state: RequestState) -> Prepared:
        data = state.request
        await self.facts.ready(state.model)
        memory = await self.cache.require(state.conversation_id)
        self._check_open(memory)
        inputs = with_pending(memory.meta, records.input_lines(state))  # messages added without a reply
        new_system = next((line["content"] for line in inputs if line["type"] == "system"), None)
        system = new_system if new_system is not None else memory.meta.system
        # instructions are this request's own system prompt; the conversation keeps its own
        sent_system = data.instructions if data.instructions is not None else system
        new_items = records.new_items(inputs)
        count = self.facts.count_tokens
        input_tokens = items_tokens(new_items, count, MESSAGE_OVERHEAD)
        input_tokens += sum(self.images.tokens(part["image"], state.model) for part in state.images)
        budget = await self.history_budget(state.model, sent_system, input_tokens, data.max_tokens)
        if budget < 0:
            window = await self.facts.context_window(state.model)
            reserve = self.facts.output_reserve(state.model, data.max_tokens)
            raise KsiError(
                ErrorCode.CONTEXT_WINDOW_EXCEEDED,
                f"the new input needs about {budget + input_tokens} tokens more than {state.model} allows "
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
            vision = (await self.facts.abilities(state.model)).vision
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
            on_chunk=self._chunk_sink(state) if data.stream or data.background else None,
            resume_session=self._resumable_session(memory, state.model, sent_system),
            request={"request_id": state.request_id, "response_id": state.response_id,
                     "conversation_id": state.conversation_id, "agent_id": state.agent_id,
                     "consortium": data.consortium},
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

    async def history_budget(self, model: str, system: str | None, input_tokens: int, max_tokens: int | None) -> int:
        """Tokens (as the daemon counts them) left for history in a turn of `model`.

        The window and the answer's reserve are the model's own tokens; dividing by the learned
        ratio turns them into the daemon's estimate, in which every stored count is kept.
        """
        window = await self.facts.context_window(model)
        reserve = self.facts.output_reserve(model, max_tokens)
        system_tokens = self.facts.count_tokens(system) + MESSAGE_OVERHEAD if system else 0
        usable = int((window - reserve) / self.calibration.ratio(model))
        return usable - system_tokens - input_tokens - NOTE_RESERVE

    async def pins_budget(self, meta: ConversationMeta) -> int:
        """The tokens a conversation's pinned exchanges may take: their share of the history budget
        of a turn of its latest model with an empty input."""
        model = meta.models[-1] if meta.models else self.settings.default_model
        budget = await self.history_budget(model, meta.system, 0, None)
        return max(0, int(budget * self.settings.pins_share))

    @staticmethod
    def _resumable_session(memory: ConversationMemory, model: str, system: str | None) -> str | None:
        """Resume a CLI session only when the previous exchange came from that same session, and
        under the same system prompt: a resumed session would never see a new one."""
        session = memory.meta.cli_session
        if not model.startswith(CLI_PREFIXES) or session is None:
            return None
        if session.model != model or session.n != memory.total or system != memory.meta.system:
            return None
        return session.session_id

    def _chunk_sink(self, state: RequestState) -> Callable[[str | dict[str, Any]], None]:
        index = 0
        context = state.context.child()

        def emit(piece: str | dict[str, Any]) -> None:
            nonlocal index
            # a text piece, or a tool call's delta: {"index", "call_id", "name", "arguments"}
            payload = {"text": piece} if isinstance(piece, str) else {"tool_call": piece}
            if isinstance(piece, str):
                self.streams.add(state.request_id, piece)
            self.router.emit("completion:chunk", {"request_id": state.request_id,
                                                  "conversation_id": state.conversation_id,
                                                  "index": index, **payload}, context)
            index += 1

        return emit

    async def _commit(self, state: RequestState, prepared: Prepared, reply: ProviderReply,
                      attempts: list[dict[str, Any]]) -> dict[str, Any]:
        """Response record durable, then the index line, then metadata; only then the result.

        The append is conditional: when another writer took the next exchange number first, the
        conversation is reloaded and the exchange appended after the new head.
        """
        memory = prepared.memory
        assert state.response_id is not None
        duration_ms = state.duration_ms()
        # the service clock (so TTLs slide with activity), one time for the record, its index line
        # and the metadata's last activity (which a reader recounts from the index after a kill)
        now = format_ts(self.clock())
        outcome = records.outcome_line(state, reply, attempts, duration_ms, now, prepared.sent)
        lines = [*prepared.inputs, outcome]
        entry = IndexEntry(
            n=memory.next_n, response_id=state.response_id, ts=outcome["ts"], model=state.model,
            provider=reply.provider, agent_id=state.agent_id, tokens_in=prepared.input_tokens,
            tokens_out=items_tokens(reply.items(), self.facts.count_tokens, MESSAGE_OVERHEAD),
            is_feedback=state.request.is_feedback, run_id=reply.extra.get("run_id"),
        )
        system = state.request.instructions if state.request.instructions is not None else prepared.system
        while True:
            entry.digest = await next_digest(self.cache, memory, system, lines, self.settings.max_fork_depth)
            meta = without_consumed(records.updated_meta(memory.meta, state, reply, entry, prepared.system,
                                                         prepared.system_changed, now), prepared.inputs)
            try:
                # Too late to cancel once the write has begun: the index line would be stored but
                # not in memory. A cancel arriving now is absorbed; the request is reported done.
                await to_the_end(
                    self.cache.store.append_exchange(state.conversation_id, entry, response=lines, meta=meta))
            except ExchangeConflict:
                await self.cache.reload(memory)
                entry.n = memory.next_n
                continue
            break
        memory.meta = meta
        memory.append(entry, Exchange(input=prepared.new_items, output=reply.items(), files=prepared.files))
        turns_left = None if meta.turn_cap is None else max(0, meta.turn_cap - memory.total)
        return records.result_data(state, reply, entry, prepared.history_stats, len(attempts), duration_ms,
                                   turns_left)

    async def _discard_if_unused(self, state: RequestState, memory: ConversationMemory | None) -> None:
        """A conversation the daemon made for this request goes when the request failed before
        anything was stored there (the failure's record stays under responses/); one the client
        named, or that another request uses, stays."""
        if not state.made_conversation or memory is None or not self._unused(state, memory):
            return
        async with memory.lock:
            # again, right before the delete: a request naming the id from this one's ack may
            # have been admitted while the lock was awaited; once retired, none is admitted
            if memory.retired or not self._unused(state, memory):
                return
            memory.retired = True
            discarded = False
            try:
                discarded = await self.cache.store.discard_unused(state.conversation_id)
            except Exception:  # kept, empty: listed with no exchanges, as before
                log.exception("discard_failed", conversation_id=state.conversation_id)
            finally:
                memory.retired = discarded
        if discarded:
            self.cache.forget(state.conversation_id)

    def _unused(self, state: RequestState, memory: ConversationMemory) -> bool:
        """No exchange in the conversation and no request on it but `state` (live or just ended)."""
        others = self.requests.count_live(state.conversation_id) - (0 if state.status in FINISHED else 1)
        return not memory.total and others <= 0

    async def _log_failure(self, state: RequestState, inputs: list[dict[str, Any]], error: KsiError,
                           attempts: list[dict[str, Any]]) -> None:
        """Failed requests are logged in responses/ but never indexed, and named in the daemon log."""
        (log.info if error.code == ErrorCode.CANCELLED else log.warning)(
            "completion_failed" if error.code != ErrorCode.CANCELLED else "completion_cancelled",
            code=error.code, reason=error.message[:300], model=state.model, conversation_id=state.conversation_id,
            request_id=state.request_id, agent_id=state.agent_id, attempts=len(attempts))
        if state.response_id is None:
            return
        line = records.error_line(state, error, attempts)
        try:
            await to_the_end(self.responses.write(state.response_id, [*inputs, line]))
        except Exception:
            log.exception("failure_log_failed", request_id=state.request_id)

    def _finish(self, state: RequestState, status: str, *, result: dict[str, Any] | None = None,
                error: KsiError | None = None) -> None:
        held = self._held.pop(state.request_id, None)
        if held is not None:
            held.users -= 1
        state.finish(status, result, error)
        self.requests.retire(state)
        self.streams.ended(state)
        self.journal.record(state.request_id, state.conversation_id, status, code=error.code if error else None)
        context = state.context.child()
        if status == "done" and result is not None:
            self.activity.succeeded(state.model, result["duration_ms"], result["usage"] or {}, result["cost"],
                                    format_ts(self.clock()))
            self.router.emit("completion:result", result, context)
        else:
            assert error is not None
            if status == "cancelled":
                self.activity.cancelled(state.model)
            else:
                self.activity.failed(state.model, error.code, error.message, format_ts(self.clock()),
                                     state.request_id, state.conversation_id)
            payload = {"request_id": state.request_id, "conversation_id": state.conversation_id,
                       "agent_id": state.agent_id, "code": error.code, "message": error.message,
                       "details": error.details}
            self.router.emit("completion:cancelled" if status == "cancelled" else "completion:error", payload, context)
