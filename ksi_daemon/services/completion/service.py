"""`completion:*` events: the requests' bookkeeping (registered, queued per conversation, ended,
reported) around three collaborators the composition root builds: admission (`admission.py`),
preparation of a turn (`preparation.py`) and running it (`running.py`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import structlog

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.events import (
    COMPLETION_ASYNC,
    COMPLETION_CANCEL,
    COMPLETION_CANCELLED,
    COMPLETION_CHUNK,
    COMPLETION_CHUNKS,
    COMPLETION_ERROR,
    COMPLETION_MODELS,
    COMPLETION_RESULT,
    COMPLETION_STATUS,
    COMPLETION_WAIT,
    CompletionFailure,
)
from ksi_common.ids import new_id, new_response_id
from ksi_common.request_status import FINISHED, RequestStatus
from ksi_common.settings import Settings
from ksi_common.timefmt import format_ts
from ksi_daemon.context import EventContext
from ksi_daemon.events import NoData
from ksi_daemon.providers.base import ReasoningPiece
from ksi_daemon.router import Router, Unregister
from ksi_daemon.services.completion.activity import CompletionActivity
from ksi_daemon.services.completion.admission import Admission, Admitted
from ksi_daemon.services.completion.compaction import Compactor
from ksi_daemon.services.completion.models import CompletionAsync, CompletionCancel, CompletionStatus, CompletionWait
from ksi_daemon.services.completion.preparation import ChunkSink
from ksi_daemon.services.completion.recovery import indexed_result, recover
from ksi_daemon.services.completion.request_view import RequestView, journal_view
from ksi_daemon.services.completion.requests import RequestRegistry, RequestState
from ksi_daemon.services.completion.running import HandedOver, TurnRunner
from ksi_daemon.services.completion.scheduler import Job, Scheduler
from ksi_daemon.services.completion.streams import ChunkLogs, CompletionChunks
from ksi_daemon.services.conversations.memory import ConversationCache, ConversationMemory
from ksi_daemon.services.conversations.writer import ConversationWriter
from ksi_daemon.services.pool.elsewhere import RequestsElsewhere
from ksi_daemon.services.pool.handover import adopted_state, request_record
from ksi_daemon.services.pool.interrupted import InterruptedResponses
from ksi_daemon.services.pool.turn import TurnState
from ksi_daemon.storage.ports import PoolRequest, RequestJournal, ResponseStore

log = structlog.get_logger("ksi.completion")

BUILTIN_MODEL = "echo/demo"  # the built-in echo provider answers every `echo/...` name


class CompletionService:
    """The `completion:*` handlers and the state of every request this daemon accepted."""

    def __init__(self, settings: Settings, router: Router, cache: ConversationCache, writer: ConversationWriter,
                 responses: ResponseStore, journal: RequestJournal, requests: RequestRegistry, scheduler: Scheduler,
                 admission: Admission, runner: TurnRunner, compactor: Compactor, elsewhere: RequestsElsewhere,
                 clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.router = router
        self.cache = cache
        self.writer = writer
        self.responses = responses
        self.journal = journal
        self.requests = requests
        self.scheduler = scheduler
        self.admission = admission
        self.runner = runner
        self.compactor = compactor
        self.elsewhere = elsewhere
        self.clock = clock
        self.images = admission.images
        self.calibration = runner.calibration
        self.breaker = runner.breaker
        self.streams = ChunkLogs()  # the chunks of background requests, readable again
        self.interrupted = InterruptedResponses(elsewhere.requests)  # the previous run's, by response id
        self.activity = CompletionActivity()
        self._held: dict[str, ConversationMemory] = {}  # request id -> the conversation it keeps in memory
        self._background: set[asyncio.Task[None]] = set()  # discards under way

    def register(self) -> list[Unregister]:
        r = self.router
        return [*self.compactor.register(),
            r.emits(COMPLETION_RESULT, COMPLETION_ERROR, COMPLETION_CANCELLED, COMPLETION_CHUNK),
            r.register(COMPLETION_ASYNC, self.handle_async, CompletionAsync,
                       "Queue a completion in a conversation; the outcome is emitted as completion:result."),
            r.register(COMPLETION_WAIT, self.handle_wait, CompletionWait,
                       "Wait for a request's result, up to a timeout."),
            r.register(COMPLETION_STATUS, self.handle_status, CompletionStatus,
                       "State of a request: queued, running, done, failed or cancelled."),
            r.register(COMPLETION_CANCEL, self.handle_cancel, CompletionCancel,
                       "Cancel a queued or running request."),
            r.register(COMPLETION_CHUNKS, self.handle_chunks, CompletionChunks,
                       "A background request's chunks after an index, its status and, once ended, its outcome."),
            r.register(COMPLETION_MODELS, self.handle_models, NoData,
                       "Models to offer by name: the default, those configured by exact name, the built-in echo."),
        ]

    async def start(self) -> None:
        for record in await recover(self.journal, self.writer.reader, self.responses):
            # accepted is durable for the pool: a live daemon (this one, once the old run's
            # heartbeat is stale) takes it over, so it is answered from there, never as lost
            pooled = (record.get("code") == ErrorCode.DAEMON_RESTART
                      and await self.elsewhere.knows(record["request_id"]))
            self.interrupted.add(record, pooled)
            if not pooled:
                self.requests.add_finished(journal_view(record))
        await self.calibration.load()

    async def stop(self, timeout: float) -> None:
        await self.scheduler.stop(timeout)
        await self.compactor.stop(timeout)
        await self.journal.close()
        await self.calibration.save()

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
            "status": state.status.value,
            "queue_position": self.scheduler.position(state.job) if state.job else 0,
            "response_id": state.response_id,
            "model": state.model,
        }

    async def handle_wait(self, data: CompletionWait, _context: EventContext) -> dict[str, Any]:
        state = self.requests.live_state(data.request_id)
        if state is None:
            return await self._wait_ended(data)
        if not state.done.is_set() and data.timeout > 0:
            try:
                async with asyncio.timeout(data.timeout):  # no task of its own, as wait_for makes
                    await state.done.wait()
            except TimeoutError:
                pass
        if state.handed_over:  # another daemon runs it now
            return await self.elsewhere.wait(data.request_id, data.timeout)
        return self.view(state).outcome()

    async def _wait_ended(self, data: CompletionWait) -> dict[str, Any]:
        """A request that ended here or in the previous run, or that another daemon of the pool accepted."""
        view = self.requests.finished(data.request_id)
        if view is None:  # accepted by another daemon of the pool (or by none)
            return await self.elsewhere.wait(data.request_id, data.timeout)
        if view.status is RequestStatus.DONE and view.result is None:
            # done before the last restart: its result is rebuilt from storage when first asked for
            line = {"request_id": view.request_id, "response_id": view.response_id,
                    "conversation_id": view.conversation_id}
            view = replace(view, result=await indexed_result(line, self.writer.reader, self.responses))
            self.requests.add_finished(view)
        return view.outcome()

    async def handle_status(self, data: CompletionStatus, _context: EventContext) -> dict[str, Any]:
        state = self.requests.live_state(data.request_id)
        view = self.view(state) if state is not None else self.requests.finished(data.request_id)
        if view is None:  # accepted by another daemon of the pool (or by none)
            return await self.elsewhere.status(data.request_id)
        return view.describe()

    async def handle_cancel(self, data: CompletionCancel, _context: EventContext) -> dict[str, Any]:
        state = self.requests.live_state(data.request_id)
        if state is None:
            view = self.requests.finished(data.request_id)
            if view is None:  # accepted by another daemon of the pool (or by none): asked to cancel it
                return await self.elsewhere.cancel(data.request_id)
            return {**view.describe(), "cancelled": False}
        if state.job is None or state.status in FINISHED:
            return {**self.describe(state), "cancelled": False}
        self.scheduler.cancel(state.job)
        # running, or withdrawn: it ends once its run unwinds or its offer is back
        if state.status is RequestStatus.RUNNING or state.job.turn.state is TurnState.WITHDRAWN:
            await state.done.wait()
        if state.handed_over:  # claimed before its offer was taken back: the claimer is asked
            return await self.elsewhere.cancel(data.request_id)
        return {**self.describe(state), "cancelled": state.status is RequestStatus.CANCELLED}

    async def handle_chunks(self, data: CompletionChunks, _context: EventContext) -> dict[str, Any]:
        try:
            return await self.streams.read(data)
        except KsiError as error:
            if error.code != ErrorCode.RESPONSE_NOT_FOUND:
                raise
            # its log went with a killed daemon: still named by its id, as failed or as the pool runs it
            view = await self.interrupted.view(data.response_id, data.wait)
            if view is None:
                raise
            return view

    async def handle_models(self, _data: NoData, _context: EventContext) -> dict[str, Any]:
        # Any model litellm reaches is served; these are the names worth offering to a picker.
        # Configured patterns (`openai/*`) name no model, so only exact names are listed.
        configured = [name for name in self.settings.models if not any(c in name for c in "*?[")]
        names = list(dict.fromkeys([self.settings.default_model, *configured, BUILTIN_MODEL]))
        return {"default": self.settings.default_model, "models": names}

    def view(self, state: RequestState) -> RequestView:
        """A request of this daemon as status and wait see it, with its place in the queue."""
        queued = state.job is not None and state.status is RequestStatus.QUEUED
        return state.view(self.scheduler.position(state.job) if queued and state.job is not None else 0)

    def describe(self, state: RequestState) -> dict[str, Any]:
        return self.view(state).describe()

    # -- submission ---------------------------------------------------------
    async def submit(self, data: CompletionAsync, context: EventContext, *, from_agent: str | None = None) -> RequestState:
        """Validate a request against its conversation and queue it; raises on bad input."""
        return await self.admission.submit(data, context, from_agent, self._enqueue)

    async def _enqueue(self, admitted: Admitted, context: EventContext, from_agent: str | None) -> RequestState:
        """Register and queue an admitted request, before the next one of its conversation is admitted."""
        data, memory, model = admitted.data, admitted.memory, admitted.model
        state = RequestState(
            request_id=new_id("req-"), conversation_id=memory.conversation_id, model=model,
            request=data, context=context, agent_id=data.agent_id or context.agent_id, from_agent=from_agent,
            # known from the ack on, so a client can name the response before it exists (a stream's first event)
            response_id=new_response_id(model), made_conversation=admitted.made_conversation,
            images=admitted.images, takes_pending=admitted.takes_pending,
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
        self.journal.record(state.request_id, state.conversation_id, RequestStatus.QUEUED,
                            response_id=state.response_id, model=state.model)
        try:  # the pool's order, and the request durable for the pool, before the ack leaves
            await self.scheduler.line_up(state.job, request_record(state))
        except KsiError as error:
            self._finish(state, RequestStatus.FAILED, error=error)
            raise
        self.scheduler.submit(state.job)
        return state

    async def cancel_conversation(self, conversation_id: str, timeout: float = 10.0) -> int:
        """Cancel every queued or running request of a conversation and wait until they ended."""
        states = [s for s in self.requests.live() if s.conversation_id == conversation_id]
        memory = self.cache.cached(conversation_id)
        committing = memory is not None and memory.lock.locked()
        for state in states:
            if state.job is None or state.status in FINISHED:
                continue
            if state.status is RequestStatus.RUNNING and committing:
                continue  # its exchange is being written: cancelling now would tear it; let it finish
            self.scheduler.cancel(state.job)
        if states:
            await asyncio.wait([asyncio.ensure_future(s.done.wait()) for s in states], timeout=timeout)
        return len(states)

    async def end_conversation(self, conversation_id: str) -> int:
        """A conversation being deleted: its requests cancelled, and its background answers no longer
        served by id (their logs would otherwise outlive it by minutes)."""
        cancelled = await self.cancel_conversation(conversation_id)
        self.streams.drop_conversation(conversation_id)
        return cancelled

    def _cancelled_in_queue(self, state: RequestState) -> None:
        error = KsiError(ErrorCode.CANCELLED, "cancelled while queued", request_id=state.request_id)
        memory = self._held.get(state.request_id)
        self._finish(state, RequestStatus.CANCELLED, error=error)
        if state.made_conversation and memory is not None:  # the empty conversation made for it goes too
            task = asyncio.get_running_loop().create_task(self.runner.discard_if_unused(state, memory))
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
            result = await indexed_result(line, self.writer.reader, self.responses)
            self.requests.add_finished(RequestView(state.request_id, state.conversation_id, RequestStatus.DONE,
                                                   response_id=state.response_id, recovered=True, result=result))
            self.journal.record(state.request_id, state.conversation_id, RequestStatus.DONE,
                                response_id=state.response_id)
            if result is not None:
                self.router.emit(COMPLETION_RESULT, result, state.context.child())
            return
        memory = await self.cache.require(state.conversation_id)
        state.job = Job(key=memory.conversation_id, model=state.model, run=lambda: self._run(state),
                        on_cancel_queued=lambda: self._cancelled_in_queue(state), ticket=state.request_id,
                        on_taken_over=lambda: self._handed_over(state))
        self.requests.add(state)
        if state.request.background:  # readable again by its id, as on the daemon that died
            self.streams.open(state)
        memory.users += 1
        self._held[state.request_id] = memory
        self.journal.record(state.request_id, state.conversation_id, RequestStatus.QUEUED,
                            response_id=state.response_id, model=state.model)
        try:
            await self.scheduler.line_up(state.job, taken.record)  # its new ticket is this daemon's
        except KsiError as error:  # ended as failed, its memory let go; the caller gives its place up
            self._finish(state, RequestStatus.FAILED, error=error)
            raise
        self.scheduler.submit(state.job)

    def _handed_over(self, state: RequestState) -> None:
        """Taken over by another daemon while this one was silent: that daemon runs it and answers
        for it; waiters here are sent there. Nothing is logged under its response id here."""
        held = self._held.pop(state.request_id, None)
        if held is not None:
            held.users -= 1
        state.handed_over = True
        self.requests.forget(state.request_id)
        if state.response_id is not None:  # a reader by response id is answered from the pool
            self.streams.handed_over(state.request_id)
            self.interrupted.add({"request_id": state.request_id, "response_id": state.response_id,
                                  "model": state.model}, pooled=True)
        state.done.set()
        log.warning("request_handed_over", request_id=state.request_id, conversation_id=state.conversation_id)

    # -- running ------------------------------------------------------------
    async def _run(self, state: RequestState) -> None:
        streamed = state.request.stream or state.request.background
        ended = await self.runner.run(state, lambda: self._chunk_sink(state) if streamed else None,
                                      lambda: self._held.get(state.request_id),
                                      # a retry's chunks replace the failed attempt's in a resumable stream
                                      lambda: self.streams.attempt(state.request_id))
        if isinstance(ended, HandedOver):
            self._handed_over(state)
        else:
            self._finish(state, ended.status, result=ended.result, error=ended.error)

    def _chunk_sink(self, state: RequestState) -> ChunkSink:
        index = 0
        context = state.context.child()

        def emit(piece: str | dict[str, Any] | ReasoningPiece) -> None:
            nonlocal index
            # a text piece, a tool call's delta ({"index", "call_id", "name", "arguments"}), or
            # reasoning: each under its own key, so a reader that knows only text skips the others
            payload: dict[str, Any]
            if isinstance(piece, str):
                payload = {"text": piece}
                self.streams.add(state.request_id, piece)
            elif isinstance(piece, ReasoningPiece):
                payload = {"reasoning": piece.payload()}
            else:
                payload = {"tool_call": piece}
            self.router.emit(COMPLETION_CHUNK, {"request_id": state.request_id,
                                                "conversation_id": state.conversation_id,
                                                "index": index, **payload}, context)
            index += 1

        return emit

    def _finish(self, state: RequestState, status: RequestStatus, *, result: dict[str, Any] | None = None,
                error: KsiError | None = None) -> None:
        held = self._held.pop(state.request_id, None)
        if held is not None:
            held.users -= 1
        state.finish(status, result, error)
        self.requests.retire(state)
        self.streams.ended(state)
        self.journal.record(state.request_id, state.conversation_id, status, code=error.code if error else None)
        context = state.context.child()
        if status is RequestStatus.DONE and result is not None:
            self.activity.succeeded(state.model, result["duration_ms"], result["usage"] or {}, result["cost"],
                                    format_ts(self.clock()))
            self.router.emit(COMPLETION_RESULT, result, context)
        else:
            assert error is not None
            if status is RequestStatus.CANCELLED:
                self.activity.cancelled(state.model)
            else:
                self.activity.failed(state.model, error.code, error.message, format_ts(self.clock()),
                                     state.request_id, state.conversation_id)
            payload: CompletionFailure = {"request_id": state.request_id, "conversation_id": state.conversation_id,
                       "agent_id": state.agent_id, "code": error.code, "message": error.message,
                       "details": error.details}
            cancelled = status is RequestStatus.CANCELLED
            self.router.emit(COMPLETION_CANCELLED if cancelled else COMPLETION_ERROR, payload, context)
