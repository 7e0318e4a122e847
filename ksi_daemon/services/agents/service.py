"""`agent:*` events: agents are named conversations with a profile; they talk, remember, message each
other, and act on the events they write into their replies."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import structlog

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.events import (
    AGENT_INFO,
    AGENT_LIST,
    AGENT_PROFILES,
    AGENT_RESET,
    AGENT_SEND_MESSAGE,
    AGENT_SPAWN,
    AGENT_TERMINATE,
    COMPLETION_CANCEL,
    COMPLETION_RESULT,
    COMPLETION_WAIT,
)
from ksi_common.ids import new_id
from ksi_common.request_status import RequestStatus
from ksi_common.settings import Settings
from ksi_common.timefmt import utc_now
from ksi_daemon.context import INTERNAL, EventContext
from ksi_daemon.events import validate
from ksi_daemon.router import Router, Unregister
from ksi_daemon.services.agents.events import (
    ChainBudget,
    FoundEvent,
    Malformed,
    Outcome,
    extract_events,
    feedback_text,
    is_allowed,
)
from ksi_daemon.services.agents.models import (
    AgentInfo,
    AgentList,
    AgentProfiles,
    AgentReset,
    AgentSendMessage,
    AgentSpawn,
    AgentTerminate,
)
from ksi_daemon.services.agents.profiles import Profile, ProfileLibrary
from ksi_daemon.services.agents.registry import AgentRegistry
from ksi_daemon.services.completion.models import CompletionAsync
from ksi_daemon.services.completion.requests import RequestState
from ksi_daemon.services.completion.service import CompletionService
from ksi_daemon.services.conversations.memory import ConversationCache
from ksi_daemon.services.conversations.writer import ConversationWriter
from ksi_daemon.storage.models import AgentRecord, ConversationMeta
from ksi_daemon.storage.ports import AgentExists, ConversationExists

log = structlog.get_logger("ksi.agent")

ID_MAX = 128


class AgentService:
    """The `agent:*` handlers, over the agent registry the completion service reads too."""

    def __init__(
        self,
        settings: Settings,
        router: Router,
        completion: CompletionService,
        cache: ConversationCache,
        writer: ConversationWriter,
        registry: AgentRegistry,
        profiles: ProfileLibrary,
    ) -> None:
        self.settings = settings
        self.router = router
        self.completion = completion
        self.cache = cache
        self.writer = writer  # an agent's conversation is created, moved and read from storage through it
        self.registry = registry
        self.store = registry.store
        self.profiles = profiles
        self.records = registry.records
        self._reserved: set[str] = set()  # ids being spawned right now
        self._tasks: set[asyncio.Task[None]] = set()  # acting on events found in replies
        self._chain_budget = ChainBudget(settings.max_events_per_chain)

    def register(self) -> list[Unregister]:
        r = self.router
        return [
            r.register(AGENT_SPAWN, self.handle_spawn, AgentSpawn,
                       "Create an agent from a profile (or a system prompt); its conversation id is its id."),
            r.register(AGENT_SEND_MESSAGE, self.handle_send, AgentSendMessage,
                       "Queue a message to an agent; wait: true or seconds replies like completion:wait."),
            r.register(AGENT_LIST, self.handle_list, AgentList, "Agents with their profile, model and status."),
            r.register(AGENT_INFO, self.handle_info, AgentInfo,
                       "One agent: profile, model, status, activity, exchanges, tokens and queued requests."),
            r.register(AGENT_PROFILES, self.handle_profiles, AgentProfiles,
                       "The profiles agents can be spawned from."),
            r.register(AGENT_RESET, self.handle_reset, AgentReset,
                       "Start the agent on a fresh conversation; the old one is kept under a new id."),
            r.register(AGENT_TERMINATE, self.handle_terminate, AgentTerminate,
                       "Stop an agent (or all: true): its queued requests are cancelled, its logs kept."),
            r.listen(COMPLETION_RESULT, self._on_result),
        ]

    async def start(self) -> None:
        await self.registry.load()
        for record in list(self.records.values()):
            await self._finish_reset(record)
        log.info("agents_loaded", count=len(self.records))

    async def stop(self, timeout: float) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=max(timeout, 0.1))

    def count(self) -> int:
        return sum(1 for record in self.records.values() if record.status == "active")

    @property
    def acting(self) -> int:
        """Replies whose events are being dispatched right now."""
        return len(self._tasks)

    # -- events -------------------------------------------------------------
    async def handle_spawn(self, data: AgentSpawn, context: EventContext) -> dict[str, Any]:
        profile = await asyncio.to_thread(self.profiles.get, data.profile) if data.profile else None
        agent_id = data.agent_id or self._new_agent_id()
        if agent_id in self.records or agent_id in self._reserved:
            existing = self.records.get(agent_id)
            raise KsiError(ErrorCode.AGENT_EXISTS, f"agent {agent_id} already exists", agent_id=agent_id,
                           status=existing.status if existing else "spawning")
        self._reserved.add(agent_id)
        try:
            if await self.writer.taken(agent_id):
                raise self._conversation_taken(agent_id)
            record = self._new_record(agent_id, data, profile, spawned_by=context.agent_id)
            parent = self.records.get(context.agent_id) if context.agent_id else None
            if parent is not None:
                # an agent cannot hand a child more than it may do itself
                record.allowed_events = [p for p in record.allowed_events if is_allowed(p, parent.allowed_events)]
            # the conversation first, created exclusively: a fork, an import or a completion racing
            # for this id either loses here or wins and the spawn is refused; never two writers
            try:
                await self.writer.create(self.writer.new_meta(agent_id, agent_id=agent_id, system=record.system,
                                                              origin="agent"))
            except ConversationExists:
                raise self._conversation_taken(agent_id) from None
            try:
                await self.store.create(record)
            except AgentExists:  # spawned by another daemon on the same storage meanwhile
                raise KsiError(ErrorCode.AGENT_EXISTS, f"agent {agent_id} already exists", agent_id=agent_id,
                               status="active") from None
            self.records[agent_id] = record
        finally:
            self._reserved.discard(agent_id)
        log.info("agent_spawned", agent_id=agent_id, profile=record.profile, spawned_by=record.spawned_by)
        reply = self._summary(record, None)
        if data.prompt is not None:
            try:
                state = await self._submit(record, data.prompt, context, from_agent=context.agent_id,
                                           stream=data.stream)
            except KsiError as error:  # the agent exists even though its first message was refused
                reply["prompt_error"] = error.to_wire()
            else:
                reply["request_id"] = state.request_id
        return reply

    async def handle_send(self, data: AgentSendMessage, context: EventContext) -> dict[str, Any]:
        record = await self.registry.active(data.agent_id)
        sender = context.agent_id  # set when another agent emitted this message
        state = await self._submit(record, data.message, context, from_agent=sender, stream=data.stream,
                                   metadata=data.metadata)
        record.last_activity = utc_now()
        if sender is None and data.wait is not False:  # messages from agents never wait
            timeout = self.settings.request_timeout if data.wait is True else float(data.wait)
            return await self.router.request(COMPLETION_WAIT, {"request_id": state.request_id, "timeout": timeout},
                                             context.child())
        return {**self.completion.describe(state), "agent_id": record.agent_id}

    async def handle_list(self, data: AgentList, _context: EventContext) -> dict[str, Any]:
        records = [r for r in await self._every_record() if data.status is None or r.status == data.status]
        metas = await self._metas([r.conversation_id for r in records])
        agents = [self._summary(r, metas.get(r.conversation_id)) for r in sorted(records, key=lambda r: r.created)]
        return {"agents": agents, "count": len(agents)}

    async def handle_info(self, data: AgentInfo, _context: EventContext) -> dict[str, Any]:
        record = await self.registry.get(data.agent_id)
        meta = (await self._metas([record.conversation_id])).get(record.conversation_id)
        requests = [self.completion.describe(s) for s in self._live(record)]
        return {
            **self._summary(record, meta),
            "system": record.system,
            "temperature": record.temperature,
            "allowed_events": record.allowed_events,
            "options": record.options,
            "metadata": record.metadata,
            "terminated_at": record.terminated_at,
            "previous_conversations": record.previous_conversations,
            "tokens": {"in": meta.tokens_in if meta else 0, "out": meta.tokens_out if meta else 0},
            "cost": meta.cost if meta else 0.0,
            "queued_requests": len(requests),
            "requests": [{k: r.get(k) for k in ("request_id", "status", "queue_position", "conversation_id")}
                         for r in requests],
        }

    async def handle_profiles(self, _data: AgentProfiles, _context: EventContext) -> dict[str, Any]:
        found = await asyncio.to_thread(self.profiles.load)
        profiles = [{**p.summary(), "model": p.model or self.settings.default_model} for p in found.profiles.values()]
        return {"profiles": profiles, "count": len(profiles), "directory": str(self.profiles.directory),
                "invalid": found.invalid}

    async def handle_reset(self, data: AgentReset, _context: EventContext) -> dict[str, Any]:
        record = await self.registry.active(data.agent_id)
        conversation_id = record.conversation_id
        cancelled: list[str] = []
        # End what is queued or running in the conversation (an exchange being written is let
        # finish, so no file moves under it); more may arrive while we wait.
        for _attempt in range(10):
            live = [s for s in self.completion.requests.live() if s.conversation_id == conversation_id]
            if not live:
                break
            await self.completion.cancel_conversation(conversation_id)
            cancelled += [s.request_id for s in live if s.status is RequestStatus.CANCELLED]
        else:
            raise KsiError(ErrorCode.OVERLOADED, f"agent {record.agent_id} keeps receiving requests; retry the reset",
                           retry_after=1.0, agent_id=record.agent_id)
        # Under the conversation's lock (a commit takes it too), so no exchange is written while
        # the conversation moves; requests admitted meanwhile run on the fresh one.
        memory = self.cache.cached(conversation_id)
        async with memory.lock if memory is not None else contextlib.nullcontext():
            if memory is not None:
                has_history = memory.total > memory.base
            else:
                has_history = await self.writer.head(conversation_id) > 0
            previous = None
            if has_history:
                previous = await self._archive_id(record)
                # the record names the previous conversation before it moves: a kill between the
                # two leaves it listed (start() drops a listed one the move never reached)
                record.previous_conversations.append(previous)
                await self.store.save(record)
                await self.writer.move(conversation_id, previous,
                                       {"reset_from": conversation_id, "reset_at": utc_now()}, memory)
            self.writer.forget(conversation_id)
            try:
                await self.writer.create(self.writer.new_meta(conversation_id, agent_id=record.agent_id,
                                                              system=record.system, origin="agent"))
            except ConversationExists:  # the reset moved nothing and the conversation is already fresh
                pass
        record.last_activity = utc_now()
        await self.store.save(record)
        log.info("agent_reset", agent_id=record.agent_id, previous_conversation_id=previous, cancelled=cancelled)
        return {"agent_id": record.agent_id, "conversation_id": conversation_id,
                "previous_conversation_id": previous, "cancelled": cancelled}

    async def handle_terminate(self, data: AgentTerminate, context: EventContext) -> dict[str, Any]:
        if data.agent_id is not None:
            targets = [await self.registry.get(data.agent_id)]
        else:
            targets = [r for r in self.records.values() if r.status == "active"]
        stopping = [r for r in targets if r.status == "active"]
        now = utc_now()
        for record in stopping:  # first, so nothing new is accepted for them while we cancel
            record.status, record.terminated_at, record.last_activity = "terminated", now, now
        live = [s for r in stopping for s in self._live(r)]
        cancelled = await self._cancel(live, context) if live else []
        for record in stopping:
            await self.store.save(record)
        for record in stopping:
            log.info("agent_terminated", agent_id=record.agent_id)
        reply: dict[str, Any] = {"terminated": [r.agent_id for r in stopping], "cancelled": cancelled,
                                 "count": len(stopping)}
        if data.agent_id is not None:
            reply.update(agent_id=data.agent_id, status="terminated")
        return reply

    # -- events written by agents ------------------------------------------
    def _on_result(self, _name: str, result: dict[str, Any], context: EventContext) -> None:
        record = self.records.get(result.get("agent_id") or "")
        content = result.get("content")
        if record is None or record.status != "active" or not isinstance(content, str) or "{" not in content:
            return  # the common case costs one lookup and one scan for "{"
        found, malformed = extract_events(content)
        if not found and not malformed:
            return
        if context.depth >= self.settings.max_event_depth:
            log.warning("agent_event_depth_limit", agent_id=record.agent_id, depth=context.depth,
                        limit=self.settings.max_event_depth, request_id=result.get("request_id"),
                        events=[f.event for f in found], malformed=len(malformed))
            return
        task = asyncio.get_running_loop().create_task(self._act(record, result, context, found, malformed))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _act(self, record: AgentRecord, result: dict[str, Any], context: EventContext,
                   found: list[FoundEvent], malformed: list[Malformed]) -> None:
        """Dispatch the allowed events one by one, then tell the agent the outcomes in one message."""
        depth = context.depth + 1
        outcomes = []
        for item in found:
            if not is_allowed(item.event, record.allowed_events):
                log.warning("agent_event_denied", code="event_not_allowed", agent_id=record.agent_id,
                            event_name=item.event, request_id=result.get("request_id"),
                            conversation_id=result.get("conversation_id"), model=result.get("model"))
                outcomes.append(Outcome(item.event, "denied"))
                continue
            if not self._chain_budget.take(context.chain_id):
                # replies that fan out to agents whose replies fan out again stay bounded as a whole
                log.warning("agent_event_chain_limit", agent_id=record.agent_id, event_name=item.event,
                            chain_id=context.chain_id, limit=self.settings.max_events_per_chain)
                outcomes.append(Outcome(item.event, "skipped", message=(
                    f"this chain of events reached its limit of {self.settings.max_events_per_chain}")))
                continue
            child = context.child(agent_id=record.agent_id, depth=depth, origin=INTERNAL)
            try:
                reply = await self.router.request(item.event, item.data, child)
            except KsiError as error:
                outcomes.append(Outcome(item.event, "error", code=error.code, message=error.message))
            except Exception as exc:
                log.exception("agent_event_failed", agent_id=record.agent_id, event_name=item.event)
                outcomes.append(Outcome(item.event, "error", code=ErrorCode.INTERNAL_ERROR,
                                        message=f"internal error: {type(exc).__name__}"))
            else:
                outcomes.append(Outcome(item.event, "ok", result=reply))
        for item in malformed:
            log.warning("agent_event_malformed", agent_id=record.agent_id, reason=item.reason,
                        request_id=result.get("request_id"))
        feedback = context.child(agent_id=record.agent_id, depth=depth, origin=INTERNAL)
        try:
            await self._submit(record, feedback_text(outcomes, malformed), feedback, is_feedback=True,
                               conversation_id=result.get("conversation_id"),
                               metadata={"feedback_for": result.get("request_id")})
        except KsiError as error:
            log.info("agent_feedback_not_sent", agent_id=record.agent_id, code=error.code, reason=error.message)

    # -- helpers ------------------------------------------------------------
    async def _finish_reset(self, record: AgentRecord) -> None:
        """A reset killed after naming the previous conversation but before moving it: the
        history is still the agent's own, so the name goes. Killed after the move wrote the new
        name's metadata but before it moved the index, that metadata is a stray copy (it counts
        exchanges it has no index for): it goes too."""
        if not record.previous_conversations:
            return
        writer = self.writer
        previous = record.previous_conversations[-1]
        if await writer.stored(previous):
            meta = await writer.load_meta(previous)
            if meta is None or meta.exchanges == 0 or await writer.head(previous) > 0:
                return  # moved whole (or there was nothing to move)
            await writer.delete_stored(previous)
        gone = record.previous_conversations.pop()
        await self.store.save(record)
        log.warning("agent_reset_rolled_back", agent_id=record.agent_id, previous_conversation_id=gone)

    @staticmethod
    def _conversation_taken(agent_id: str) -> KsiError:
        return KsiError(ErrorCode.CONVERSATION_EXISTS,
                        f"a conversation {agent_id} already exists; an agent's id names its conversation",
                        conversation_id=agent_id, fields={"agent_id": "a conversation with this id already exists"})

    def _model(self, record: AgentRecord) -> str:
        return self.registry.model(record)

    def _new_agent_id(self) -> str:
        while True:
            agent_id = new_id("agent_", 8)
            if agent_id not in self.records and agent_id not in self._reserved:
                return agent_id

    def _new_record(self, agent_id: str, data: AgentSpawn, profile: Profile | None,
                    spawned_by: str | None) -> AgentRecord:
        return AgentRecord(
            agent_id=agent_id,
            conversation_id=agent_id,
            profile=profile.name if profile else None,
            model=data.model or (profile.model if profile else None),
            system=data.system if data.system is not None else (profile.system if profile else None),
            temperature=data.temperature if data.temperature is not None else (profile.temperature if profile else None),
            allowed_events=list(profile.allowed_events) if profile else [],
            options=dict(profile.options) if profile else {},
            metadata=data.metadata,
            spawned_by=spawned_by,
        )

    async def _archive_id(self, record: AgentRecord) -> str:
        """`{agent_id}-{n}`, the first n not taken (shortened to stay a valid id)."""
        n = len(record.previous_conversations) + 1
        while True:
            suffix = f"-{n}"
            candidate = record.agent_id[: ID_MAX - len(suffix)] + suffix
            if not await self.writer.taken(candidate):
                return candidate
            n += 1

    async def _submit(self, record: AgentRecord, message: str, context: EventContext, *,
                      from_agent: str | None = None, stream: bool = False, is_feedback: bool = False,
                      conversation_id: str | None = None, metadata: dict[str, Any] | None = None) -> RequestState:
        payload: dict[str, Any] = {"agent_id": record.agent_id, "prompt": message, "stream": stream,
                                   "is_feedback": is_feedback, "origin": "agent"}
        if conversation_id is not None:
            payload["conversation_id"] = conversation_id
        if record.temperature is not None:
            payload["temperature"] = record.temperature
        if record.options:
            payload["options"] = dict(record.options)
        if metadata:
            payload["metadata"] = metadata
        request = validate(CompletionAsync, payload)
        assert isinstance(request, CompletionAsync)
        return await self.completion.submit(request, context, from_agent=from_agent)

    def _live(self, record: AgentRecord) -> list[RequestState]:
        return [s for s in self.completion.requests.live()
                if s.agent_id == record.agent_id or s.conversation_id == record.conversation_id]

    async def _cancel(self, states: list[RequestState], context: EventContext) -> list[str]:
        """Cancel through `completion:cancel`, so the cancellations show on the bus like any other."""
        replies = await asyncio.gather(
            *(self.router.request(COMPLETION_CANCEL, {"request_id": s.request_id}, context.child())
              for s in states),
            return_exceptions=True,
        )
        cancelled = []
        for state, reply in zip(states, replies, strict=True):
            if isinstance(reply, BaseException):
                log.warning("agent_cancel_failed", request_id=state.request_id, error=repr(reply))
            elif reply.get("cancelled"):
                cancelled.append(state.request_id)
        return cancelled

    async def _every_record(self) -> list[AgentRecord]:
        """Every agent: on a shared backend the stored records, where other daemons spawn,
        message and terminate agents too; else (and for one not stored yet) those in memory."""
        if not self.writer.shared:
            return list(self.records.values())
        stored = {record.agent_id: record for record in await self.registry.store.load_all()}
        return [*stored.values(), *(r for r in self.records.values() if r.agent_id not in stored)]

    async def _metas(self, conversation_ids: list[str]) -> dict[str, ConversationMeta]:
        """Conversation metadata from memory when loaded, else from storage (without caching it).
        On a shared backend always from storage: another daemon may have run turns since."""
        metas: dict[str, ConversationMeta] = {}
        missing = []
        for conversation_id in conversation_ids:
            memory = None if self.writer.shared else self.cache.cached(conversation_id)
            if memory is not None:
                metas[conversation_id] = memory.meta
            else:
                missing.append(conversation_id)
        if missing:
            loaded = [await self.writer.load_meta(c) for c in missing]
            metas.update({c: m for c, m in zip(missing, loaded, strict=True) if m is not None})
        return metas

    def _summary(self, record: AgentRecord, meta: ConversationMeta | None) -> dict[str, Any]:
        last = max(record.last_activity, meta.last_activity) if meta and meta.exchanges else record.last_activity
        return {
            "agent_id": record.agent_id,
            "conversation_id": record.conversation_id,
            "profile": record.profile,
            "model": self._model(record),
            "status": record.status,
            "created": record.created,
            "last_activity": last,
            "exchanges": meta.exchanges if meta else 0,
            "spawned_by": record.spawned_by,
        }
