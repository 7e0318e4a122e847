"""Admission of a completion request: the checks that refuse it at its ack (capacity, options the
model cannot take, tools, images, files, an unknown consortium, a closed or full conversation),
and the conversation it runs in (found, created, continued after a response, or matched from a
client-held history), before the completion service queues it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.events import CONVERSATION_FORK
from ksi_common.ids import new_id
from ksi_common.items import call_ids_answered
from ksi_common.request_status import RequestStatus
from ksi_common.settings import Settings
from ksi_common.timefmt import format_ts, parse_ts
from ksi_daemon.context import EventContext
from ksi_daemon.providers.abilities import refuse_unable
from ksi_daemon.providers.options import check_options, is_routing_option
from ksi_daemon.router import Router
from ksi_daemon.services.completion import exchange_records as records
from ksi_daemon.services.completion import tool_turns
from ksi_daemon.services.completion.answerers import Answerers
from ksi_daemon.services.completion.appended_turns import AppendedTurns
from ksi_daemon.services.completion.attachments import Attachments
from ksi_daemon.services.completion.client_history import ClientHistory, admission_key
from ksi_daemon.services.completion.images import CheckedImage, Images
from ksi_daemon.services.completion.item_references import ItemReferences
from ksi_daemon.services.completion.models import CompletionAsync
from ksi_daemon.services.completion.requests import RequestRegistry, RequestState
from ksi_daemon.services.completion.scheduler import Scheduler
from ksi_daemon.services.conversations.adoption import MADE_FOR_RUN
from ksi_daemon.services.conversations.memory import ConversationCache, ConversationMemory
from ksi_daemon.services.conversations.pending import pending_taken
from ksi_daemon.services.conversations.responses import locate
from ksi_daemon.services.conversations.scope import request_scope
from ksi_daemon.services.conversations.writer import ConversationWriter
from ksi_daemon.storage.ports import ConversationExists, ResponseStore

log = structlog.get_logger("ksi.completion")

INLINE_CONSORTIUM = "consortium/inline"  # the model of a request carrying its own consortium definition


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


@dataclass(slots=True)
class _Turn:
    """The admission turn of one conversation: its requests are admitted one after another."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


@dataclass(slots=True)
class Admitted:
    """A request that passed its checks, with the conversation it runs in and its model."""

    data: CompletionAsync
    memory: ConversationMemory
    model: str
    made_conversation: bool  # made for this request (discarded when it fails before storing anything)
    images: list[dict[str, Any]]  # the new input's images, stored, as parts
    takes_pending: tuple[str, ...] = ()  # ids of its conversation's pending input it was matched by: its new input


# the completion service's bookkeeping of an admitted request: queued before the next is admitted
Enqueue = Callable[[Admitted, EventContext, str | None], Awaitable[RequestState]]


def check_open(memory: ConversationMemory, now: float) -> None:
    """Refuse a turn in an archived or expired conversation."""
    meta = memory.meta
    if meta.status == "archived":
        raise KsiError(ErrorCode.CONVERSATION_ARCHIVED,
                       f"conversation {meta.conversation_id} is archived; set it active to continue",
                       conversation_id=meta.conversation_id)
    if meta.ttl is not None and parse_ts(meta.last_activity) + meta.ttl < now:
        raise KsiError(ErrorCode.CONVERSATION_EXPIRED, f"conversation {meta.conversation_id} expired",
                       conversation_id=meta.conversation_id,
                       expired_at=format_ts(parse_ts(meta.last_activity) + meta.ttl))


class Admission:
    """Admits completion requests one conversation at a time, in arrival order."""

    def __init__(self, settings: Settings, router: Router, cache: ConversationCache, writer: ConversationWriter,
                 responses: ResponseStore, answerers: Answerers, images: Images,
                 attachments: Attachments, scheduler: Scheduler, requests: RequestRegistry,
                 agents: AgentDirectory | None = None, clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.router = router
        self.cache = cache
        self.writer = writer
        self.responses = responses
        self.answerers = answerers
        self.images = images
        self.attachments = attachments
        self.scheduler = scheduler
        self.requests = requests
        self.agents: AgentDirectory = agents or NoAgents()
        self.clock = clock
        self._overload_logged_at = -1.0e9
        self._admitting: dict[str, _Turn] = {}  # conversation (or agent) id -> its admission turn
        self._history_admission = asyncio.Lock()  # see submit
        self.client_history = ClientHistory(cache, responses, router, requests.count_live, self.can_continue,
                                            settings.max_fork_depth, settings.pending_match_window, clock,
                                            scheduler.in_line)
        self.appended_turns = AppendedTurns(cache, responses, router, requests.count_live)
        self.item_references = ItemReferences(cache, responses)

    async def submit(self, data: CompletionAsync, context: EventContext, from_agent: str | None,
                     enqueue: Enqueue) -> RequestState:
        """Validate a request against its conversation and have `enqueue` queue it; raises on bad input.

        Requests naming one conversation are admitted one at a time, in arrival order: loading a
        cold conversation or creating a new one suspends, and a later request must not overtake
        an earlier one (or create the same conversation a second time) meanwhile.
        """
        data = await self._dereferenced(data)
        if data.previous_response_id is not None:
            self._refuse_running(data.previous_response_id)
        if data.appended:
            async with self._history_admission:  # as a history: matched and written before its admission
                data = await self.appended_turns.resolve(data, context, self.check_before_write)
                return await self._submit(data, context, from_agent, enqueue)
        if data.history or self.client_history.may_take_pending(data):
            # one client-held history (or input some conversation holds pending) at a time, from
            # matching it to admitting its request: two identical ones sent at once must not both
            # continue the same conversation in place (the second sees the first admitted there:
            # a history forks, input another conversation held pending starts a conversation of its own)
            # on a pool, the same history (or input) admitted on another daemon meanwhile is seen
            # only once its turn is lined up there: one such request at a time over the whole pool
            async with self._history_admission, self.scheduler.exclusive(admission_key(data)):
                # an agent's profile supplies the system prompt its client never sees, so never resends
                agent_system = (await self.agents.defaults(data.agent_id)).system if data.agent_id else None
                resolved = await self.client_history.resolve(data, context, self.check_before_write, agent_system)
                return await self._submit(resolved.data, context, from_agent, enqueue, resolved.takes_pending)
        return await self._submit(data, context, from_agent, enqueue)

    def _refuse_running(self, response_id: str) -> None:
        """A response still queued or running has no exchange to continue after yet: said so, as
        not found would send a client to look for a wrong id (waiting here would hold admission)."""
        running = self.requests.live_response(response_id)
        if running is None:
            return
        status = "in_progress" if running.status is RequestStatus.RUNNING else "queued"
        raise KsiError(ErrorCode.PREVIOUS_RESPONSE_IN_PROGRESS,
                       f"response {response_id} is still {status.replace('_', ' ')}: continue after it once it "
                       "has completed (poll it, or wait for its result)", response_id=response_id, status=status,
                       request_id=running.request_id,
                       fields={"previous_response_id": "a response that has completed"})

    async def _dereferenced(self, data: CompletionAsync) -> CompletionAsync:
        """`data` with the item references of its history or appended items resolved (refused,
        before anything is written, when one names no item of the request's scope)."""
        scope = request_scope(data.agent_id, data.options)
        if data.previous_by_item and data.previous_response_id is not None:
            await self.item_references.check_scope(data.previous_response_id, scope)
        changes = {name: await self.item_references.resolved(raw, name, scope)
                   for name, raw in (("history", data.history), ("appended", data.appended)) if raw}
        return data.model_copy(update=changes) if changes else data

    async def _submit(self, data: CompletionAsync, context: EventContext, from_agent: str | None,
                      enqueue: Enqueue, takes_pending: tuple[str, ...] = ()) -> RequestState:
        continued = data.previous_response_id is not None
        if continued:
            data = await self._continue_after(data, context)
        if not takes_pending and data.conversation_id is not None and (
                continued or call_ids_answered(data.input_items())):
            # a session that added this very input to the conversation (a call's output) before
            # asking for the response answering it: the pending input is this input, taken once
            memory = await self.cache.get(data.conversation_id)
            takes_pending = pending_taken(memory.meta, data.input_items()) if memory is not None else ()
        key = data.conversation_id or data.agent_id
        if key is None:
            return await self._admit(data, context, from_agent, enqueue, takes_pending)
        admission = self._admitting.get(key)
        if admission is None:
            admission = self._admitting[key] = _Turn()
        admission.users += 1
        try:
            async with admission.lock:
                return await self._admit(data, context, from_agent, enqueue, takes_pending)
        finally:
            admission.users -= 1
            if not admission.users:
                self._admitting.pop(key, None)

    async def _continue_after(self, data: CompletionAsync, context: EventContext) -> CompletionAsync:
        """The request continuing the conversation of `previous_response_id`: in that conversation
        when the response is its newest exchange and nothing else is queued there (so nothing can
        come between, on any daemon of the pool), else in a fork at that exchange (copy-free, as
        conversation:fork makes it)."""
        assert data.previous_response_id is not None
        found = await locate(self.cache, self.responses, data.previous_response_id,
                             ErrorCode.PREVIOUS_RESPONSE_NOT_FOUND)
        if found.memory is None or found.n is None:
            raise KsiError(ErrorCode.PREVIOUS_RESPONSE_NOT_FOUND,
                           f"response {data.previous_response_id} is in no conversation's history (it failed, "
                           "or its conversation was deleted)", response_id=data.previous_response_id)
        conversation_id = found.memory.conversation_id
        if (not found.newest or self.requests.count_live(conversation_id)
                or await self.scheduler.in_line(conversation_id)):
            fork_data: dict[str, Any] = {"conversation_id": conversation_id, "at": found.n}
            if data.origin is not None:
                fork_data["origin"] = data.origin
            fork = await self.router.request(CONVERSATION_FORK, fork_data, context.child())
            conversation_id = fork["conversation_id"]
        return data.model_copy(update={"conversation_id": conversation_id, "previous_response_id": None})

    async def _admit(self, data: CompletionAsync, context: EventContext, from_agent: str | None,
                     enqueue: Enqueue, takes_pending: tuple[str, ...] = ()) -> RequestState:
        self._check_capacity()  # refuse before any work is done or any conversation is written
        images: list[CheckedImage] = []
        if data.files:  # refused files fail the ack before any conversation is written
            files, images = await self.images.split_files(data.files)  # images are read here, once
            data = data.model_copy(update={"files": await self.attachments.check(files)})
        for where, part in data.media_parts():  # an https URL is kept as it is, never fetched
            images.append(await self.images.check(part, where))
        agent = await self.agents.defaults(data.agent_id) if data.agent_id else None
        chosen = data.model or (INLINE_CONSORTIUM if data.consortium else None) or (agent.model if agent else None)
        conversation_id = data.conversation_id or (agent.conversation_id if agent else None)
        if chosen is not None or conversation_id is None:  # before a new conversation is written
            await self.answerers.check_up_front(chosen or self.settings.default_model, data.consortium)
            await self._check_model_options(chosen or self.settings.default_model, data, images)
        await tool_turns.check_new_conversation(self.cache, conversation_id, data)
        memory = await self._conversation_for(conversation_id, data, agent, chosen)
        check_open(memory, self.clock())
        await tool_turns.check_turn(self.cache, memory, data, self.settings.max_fork_depth)
        if memory.meta.turn_cap is not None:
            pending = self.requests.count_live(memory.conversation_id)
            if memory.total + pending >= memory.meta.turn_cap:
                raise KsiError(ErrorCode.CONVERSATION_FULL,
                               f"conversation {memory.conversation_id} reached its cap of {memory.meta.turn_cap} exchanges",
                               conversation_id=memory.conversation_id, turn_cap=memory.meta.turn_cap)
        model = chosen or self._last_model(memory) or self.settings.default_model
        if chosen is None and conversation_id is not None:
            await self.answerers.check_up_front(model, data.consortium)
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
            self._check_admissible(memory)  # again: the store awaited; nothing waits from here until
            # `enqueue` has registered the request (its first wait is for the pool's line)
        else:
            stored_images = []
        admitted = Admitted(data, memory, model, made_conversation=conversation_id is None, images=stored_images,
                            takes_pending=takes_pending)
        return await enqueue(admitted, context, from_agent)

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
        options = data.provider_options()
        if options or data.tools or images:  # abilities are looked up only when something asks for one
            refuse_unable(model, await self.answerers.abilities(model), options, bool(data.tools),
                          [image.field for image in images if image.kind == "input_image"],
                          [image.field for image in images if image.kind == "input_file"])

    def _check_options(self, model: str, data: CompletionAsync) -> None:
        check_options(model, data.options, self.settings.model_settings(model).allow_options)

    async def _conversation_for(self, conversation_id: str | None, data: CompletionAsync,
                                agent: AgentDefaults | None, chosen: str | None) -> ConversationMemory:
        if any(is_routing_option(name) for name in data.options) and (
                conversation_id is None or self.cache.cached(conversation_id) is None):
            # a new conversation answers with the chosen or the default model: refuse its options
            # before anything is written (an existing one is checked against its own last model)
            if conversation_id is None or not await self.writer.stored(conversation_id):
                self._check_options(chosen or self.settings.default_model, data)
        # Another tool's id for this conversation (llm's, say) is kept in its metadata, so the link
        # survives restarts of both and any door can show it.
        kept = {"external_ids": dict(data.external_ids) or None,
                "scope": request_scope(data.agent_id, data.options) or None}  # whom a resent history matches for
        # the preview is recorded with the creation, so the first exchange's metadata differs from
        # it only in its totals (which the JSONL store saves lazily) and costs no extra write
        if conversation_id is None:  # a session may add this run's items to its own conversation later
            return await self._create_conversation(new_id("conv-"), for_request=True, agent_id=data.agent_id,
                                                   system=agent.system if agent else None, **kept,
                                                   extra={MADE_FOR_RUN: True},
                                                   origin=data.origin, preview=records.first_input_preview(data))
        memory = await self.cache.get(conversation_id)
        if memory is not None and not memory.retired:  # a retired one is being discarded: gone
            return memory
        own_agent_conversation = agent is not None and conversation_id == agent.conversation_id
        if not (data.create or own_agent_conversation):
            raise KsiError(ErrorCode.CONVERSATION_NOT_FOUND, f"conversation {conversation_id} does not exist",
                           conversation_id=conversation_id)
        try:
            return await self._create_conversation(conversation_id, for_request=True, agent_id=data.agent_id,
                                                   system=agent.system if agent else None, **kept,
                                                   origin=data.origin, preview=records.first_input_preview(data))
        except ConversationExists:  # another daemon created it meanwhile: continue it
            return await self.cache.require(conversation_id)

    async def _create_conversation(self, conversation_id: str, *, for_request: bool = False,
                                   **fields: Any) -> ConversationMemory:
        """A new conversation (exclusive: raises `ConversationExists` when the id is taken);
        `for_request`: created for a request, durable with its first exchange."""
        return await self.writer.create(self.writer.new_meta(conversation_id, **fields), for_request=for_request)

    async def check_before_write(self, data: CompletionAsync) -> None:
        """What `_admit` refuses before a new conversation is written, for one written for a history."""
        self._check_capacity()
        model = data.model or (INLINE_CONSORTIUM if data.consortium else None) or self.settings.default_model
        await self.answerers.check_up_front(model, data.consortium)
        images: list[CheckedImage] = []
        if data.files:  # read again at admission: a refused file or image must not leave a history written
            files, images = await self.images.split_files(data.files)
            await self.attachments.check(files)
        images += [await self.images.check(part, field) for field, part in data.media_parts()]
        await self._check_model_options(model, data, images)
        self._check_options(model, data)

    def can_continue(self, memory: ConversationMemory) -> bool:
        """Not archived, not expired, not full: a request may be appended to it."""
        try:
            check_open(memory, self.clock())
        except KsiError:
            return False
        cap = memory.meta.turn_cap
        return cap is None or memory.total + self.requests.count_live(memory.conversation_id) < cap

    @staticmethod
    def _last_model(memory: ConversationMemory) -> str | None:
        # an inline consortium cannot answer again without its definition: the turn after one
        # goes to the model used before it (or the default)
        return next((m for m in reversed(memory.meta.models) if m != INLINE_CONSORTIUM), None)
