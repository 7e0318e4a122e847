"""Running a prepared turn: the provider call with its retries and circuit breaker, the commit of
the exchange through the conversation writer, and the failure's record when it fails."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.records import IndexEntry
from ksi_common.request_status import FINISHED, RequestStatus
from ksi_common.settings import Settings
from ksi_common.timefmt import format_ts
from ksi_daemon.providers.base import Provider, ProviderCall, ProviderFailure, ProviderReply
from ksi_daemon.providers.options import circuit_key
from ksi_daemon.services.cancellation import to_the_end
from ksi_daemon.services.completion import exchange_records as records
from ksi_daemon.services.completion.answerers import Answerers
from ksi_daemon.services.completion.calibration import Calibration
from ksi_daemon.services.completion.preparation import ChunkSink, Prepared, TurnPreparation
from ksi_daemon.services.completion.requests import RequestRegistry, RequestState
from ksi_daemon.services.completion.tool_call_cap import call_limit, capped_reply, capped_sink
from ksi_daemon.services.conversations.history import MESSAGE_OVERHEAD
from ksi_daemon.services.conversations.memory import ConversationMemory, Exchange, items_tokens
from ksi_daemon.services.conversations.pending import without_consumed
from ksi_daemon.services.conversations.writer import ConversationWriter, NewExchange
from ksi_daemon.services.pool.elsewhere import RequestsElsewhere
from ksi_daemon.services.resilience import CircuitBreaker, RetryPolicy, with_retries
from ksi_daemon.storage.models import ConversationMeta
from ksi_daemon.storage.ports import ResponseStore

log = structlog.get_logger("ksi.completion")

CALIBRATION_SAVE_INTERVAL = 5.0  # seconds: a crash loses at most this much learning


@dataclass(slots=True)
class Ended:
    """How a turn ended: done with its result, failed or cancelled with its error."""

    status: RequestStatus
    result: dict[str, Any] | None = None
    error: KsiError | None = None


@dataclass(frozen=True, slots=True)
class HandedOver:
    """The turn did not end here: another daemon of the pool took the request over while this one
    was silent, and runs it again under the same ids."""


class TurnRunner:
    """Runs each turn: preparation, the provider call, the commit; one per daemon."""

    def __init__(self, settings: Settings, preparation: TurnPreparation, writer: ConversationWriter,
                 responses: ResponseStore, answerers: Answerers, requests: RequestRegistry,
                 elsewhere: RequestsElsewhere, breaker: CircuitBreaker,
                 count_tokens: Callable[[str], int], clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.preparation = preparation
        self.calibration: Calibration = preparation.calibration
        self.writer = writer
        self.responses = responses
        self.answerers = answerers
        self.requests = requests
        self.elsewhere = elsewhere
        self.retry = RetryPolicy(settings.retry_attempts, settings.retry_base_delay, settings.retry_max_delay)
        self.breaker = breaker
        self.count_tokens = count_tokens
        self.clock = clock
        self._calibration_saved = time.monotonic()
        self._background: set[asyncio.Task[Any]] = set()  # calibration saves under way

    async def run(self, state: RequestState, chunk_sink: Callable[[], ChunkSink | None],
                  held: Callable[[], ConversationMemory | None],
                  attempt_started: Callable[[], None]) -> Ended | HandedOver:
        """Prepare, call and commit the request's turn (each preparation streams to a new
        `chunk_sink()`; `attempt_started()` before each provider attempt); a failure is logged under its response id and a conversation made for it
        alone (`held()`: the one it keeps in memory) is discarded. Never raises: the end says how."""
        state.status = RequestStatus.RUNNING
        state.started_at = time.perf_counter()
        attempts: list[dict[str, Any]] = []
        inputs = records.input_lines(state)
        limit = call_limit(state.request.options)  # KSI's to keep: no chat provider takes it
        try:
            prepared = await self.preparation.prepare(state, capped_sink(chunk_sink(), limit))
            inputs = prepared.inputs
            answerer = self.answerers.for_model(state.model)
            try:
                reply = await self._call(state, answerer, prepared, attempts, attempt_started)
            except KsiError as error:
                if error.code != ErrorCode.CONTEXT_WINDOW_EXCEEDED or not self.calibration.enabled:
                    raise
                # the model counts more tokens than we thought: count more strictly, retry once
                self.calibration.tighten(state.model)
                prepared = await self.preparation.prepare(state, capped_sink(chunk_sink(), limit))
                inputs = prepared.inputs
                reply = await self._call(state, answerer, prepared, attempts, attempt_started)
            reply = capped_reply(reply, limit)
            async with prepared.memory.lock:  # conversation:update/delete change metadata under it too
                result = await self._commit(state, prepared, reply, attempts)
        except asyncio.CancelledError:
            error = KsiError(ErrorCode.CANCELLED, "cancelled while running", request_id=state.request_id)
            await self._log_failure(state, inputs, error, attempts)
            await self.discard_if_unused(state, held())
            return Ended(RequestStatus.CANCELLED, error=error)
        except KsiError as error:
            if error.code == ErrorCode.LEASE_LOST and await self.elsewhere.taken_from_here(state.request_id):
                return HandedOver()  # the daemon that took it over runs it again, under the same ids
            await self._log_failure(state, inputs, error, attempts)
            await self.discard_if_unused(state, held())
            return Ended(RequestStatus.FAILED, error=error)
        except Exception as exc:
            log.exception("completion_failed", request_id=state.request_id)
            error = KsiError(ErrorCode.INTERNAL_ERROR, f"internal error: {type(exc).__name__}")
            await self._log_failure(state, inputs, error, attempts)
            await self.discard_if_unused(state, held())
            return Ended(RequestStatus.FAILED, error=error)
        return Ended(RequestStatus.DONE, result=result)

    async def _call(self, state: RequestState, answerer: Provider, prepared: Prepared,
                    attempts: list[dict[str, Any]], attempt_started: Callable[[], None]) -> ProviderReply:
        async def attempt() -> ProviderReply:
            attempt_started()
            return await self._attempt(answerer, prepared.call)

        reply = await with_retries(attempt,
                                   self.retry, self.breaker, self._circuit_key(state.model, prepared.call.options), attempts,
                                   log_fields={"request_id": state.request_id, "conversation_id": state.conversation_id,
                                               "model": state.model})
        if answerer.calibrated and prepared.call.resume_session is None:
            # a resumed session, a CLI or a consortium counts a prompt we never built: nothing to learn
            self.calibration.observe(state.model, prepared.estimate, reply.usage.get("prompt_tokens", 0))
            self._save_calibration_now_and_then()
        return reply

    def _circuit_key(self, model: str, options: dict[str, Any]) -> str:
        return circuit_key(model, self.settings.model_settings(model).api_base, options)

    async def _attempt(self, answerer: Provider, call: ProviderCall) -> ProviderReply:
        timeout = call.timeout or self.settings.request_timeout
        try:
            async with asyncio.timeout(timeout):  # no task of its own, as wait_for makes
                return await answerer.complete(call)
        except TimeoutError:
            raise ProviderFailure(ErrorCode.TIMEOUT, f"no answer within {timeout}s", retryable=True) from None

    def _save_calibration_now_and_then(self) -> None:
        """Learned ratios reach storage at most every few seconds, in the background (and at stop)."""
        now = time.monotonic()
        if self.calibration.dirty and now - self._calibration_saved > CALIBRATION_SAVE_INTERVAL:
            self._calibration_saved = now
            task = asyncio.get_running_loop().create_task(self.calibration.save())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

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
        outcome = records.outcome_line(state, reply, attempts, duration_ms, now,
                                       prepared.sent_record(reply.breakpoints))
        lines = [*prepared.inputs, outcome]
        entry = IndexEntry(
            n=memory.next_n, response_id=state.response_id, ts=outcome["ts"], model=state.model,
            provider=reply.provider, agent_id=state.agent_id, tokens_in=prepared.input_tokens,
            tokens_out=items_tokens(reply.items(), self.count_tokens, MESSAGE_OVERHEAD),
            is_feedback=state.request.is_feedback, run_id=reply.extra.get("run_id"),
        )
        system = state.request.instructions if state.request.instructions is not None else prepared.system
        exchange = Exchange(input=prepared.new_items, output=reply.items(), files=prepared.files)

        def meta_after(meta: ConversationMeta, _entries: list[IndexEntry]) -> ConversationMeta:
            return without_consumed(records.updated_meta(meta, state, reply, entry, prepared.system,
                                                         prepared.system_changed, now), prepared.inputs)

        meta = await self.writer.commit(memory, [NewExchange(entry, lines, exchange)], system, meta_after)
        turns_left = None if meta.turn_cap is None else max(0, meta.turn_cap - memory.total)
        return records.result_data(state, reply, entry, prepared.history_stats, len(attempts), duration_ms,
                                   turns_left)

    async def discard_if_unused(self, state: RequestState, memory: ConversationMemory | None) -> None:
        """A conversation the daemon made for this request goes when the request failed before
        anything was stored there (the failure's record stays under responses/); one the client
        named, or that another request uses, stays."""
        if not state.made_conversation or memory is None or not self._unused(state, memory):
            return
        # again, right before the delete: a request naming the id from this one's ack may have
        # been admitted while the lock was awaited; once retired, none is admitted
        await self.writer.discard_unused(memory, lambda: self._unused(state, memory))

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
