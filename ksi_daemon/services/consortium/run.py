"""One consortium run: members answer in parallel, the arbiter judges, rounds repeat until it is
confident; every call is logged as its own response file and every step in the run's trace."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any

import structlog

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.ids import new_response_id
from ksi_common.items import message
from ksi_common.timefmt import utc_now
from ksi_daemon.providers.base import Provider, ProviderCall, ProviderFailure, ProviderReply
from ksi_daemon.services.cancellation import to_the_end
from ksi_daemon.services.consortium.arbiter import (
    Judged,
    MemberAnswer,
    arbiter_messages,
    read_verdict,
    refinement_turns,
)
from ksi_daemon.services.consortium.models import ConsortiumDefinition
from ksi_daemon.services.conversations.response_lines import answer_line, error_line, message_line
from ksi_daemon.services.resilience import CircuitBreaker, RetryPolicy, with_retries
from ksi_daemon.storage.ports import ResponseStore, TraceStore

log = structlog.get_logger("ksi.consortium")

USAGE_KEYS = ("prompt_tokens", "completion_tokens", "total_tokens")


@dataclass(slots=True)
class RunParts:
    """What every run shares, handed down by the consortium service."""

    provider: Provider
    responses: ResponseStore
    traces: TraceStore
    retry: RetryPolicy
    breaker: CircuitBreaker
    circuit: Callable[[str, dict[str, Any]], str]  # the breaker's key of a call to a model with options
    slot: Callable[[str], AbstractAsyncContextManager[Any]]  # bounds concurrent calls per model
    default_timeout: float


@dataclass(slots=True)
class Outcome:
    """One member or arbiter call: its answer or why it failed, and what it cost."""

    role: str
    model: str
    instance: int
    iteration: int
    response_id: str
    ok: bool = False
    content: str = ""
    code: str | None = None
    message: str | None = None
    details: dict[str, Any] = field(default_factory=dict)
    usage: dict[str, int] = field(default_factory=dict)
    cost: float | None = None
    finish_reason: str | None = None
    duration_ms: float = 0.0
    attempts: list[dict[str, Any]] = field(default_factory=list)

    def trace(self) -> dict[str, Any]:
        line: dict[str, Any] = {"event": self.role, "iteration": self.iteration, "model": self.model,
                                "instance": self.instance, "response_id": self.response_id, "ok": self.ok,
                                "duration_ms": self.duration_ms, "attempts": self.attempts}
        if self.ok:
            line.update(usage=self.usage, cost=self.cost, finish_reason=self.finish_reason)
            if self.role == "member":
                line["content"] = self.content
        else:
            line.update(code=self.code, message=self.message, details=self.details)
        return line


def split_messages(messages: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]], list[dict[str, Any]]]:
    """The rebuilt conversation as (system text, earlier turns, the new input)."""
    system = None
    start = 0
    if messages and messages[0].get("role") == "system":
        system = str(messages[0].get("content") or "")
        start = 1
    last_reply = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=start - 1)
    history = messages[start:last_reply + 1]
    new_input = [m for m in messages[last_reply + 1:] if m.get("role") != "system"]
    return system, history, new_input


def with_member_system(messages: list[dict[str, Any]], extra: str | None) -> list[dict[str, Any]]:
    """The conversation's messages with the members' system prompt after the conversation's own."""
    if not extra:
        return list(messages)
    if messages and messages[0].get("role") == "system":
        merged = f"{messages[0].get('content') or ''}\n\n{extra}".lstrip()
        return [{"role": "system", "content": merged}, *messages[1:]]
    return [{"role": "system", "content": extra}, *messages]


@dataclass(slots=True)
class _Rounds:
    """A run's rounds so far: what every member is sent, and the verdicts."""

    member_base: list[dict[str, Any]]  # the conversation with the members' system prompt
    system: str | None
    history: list[dict[str, Any]]
    new_input: list[dict[str, Any]]
    judged: list[Judged] = field(default_factory=list)
    rounds: list[list[MemberAnswer]] = field(default_factory=list)
    fallback: dict[str, Any] | None = None
    parse: str = "json"


class ConsortiumRun:
    def __init__(self, run_id: str, name: str, definition: ConsortiumDefinition, call: ProviderCall,
                 parts: RunParts) -> None:
        self.run_id = run_id
        self.name = name
        self.definition = definition
        self.call = call
        self.parts = parts
        self.request = call.request
        self.usage: dict[str, int] = dict.fromkeys(USAGE_KEYS, 0)
        self.cost: float | None = None
        self.calls = 0
        # members finish in parallel: their trace lines are appended one at a time, in order
        self._trace_lock = asyncio.Lock()
        self.timeout = call.timeout or parts.default_timeout
        loop = asyncio.get_running_loop()
        self.deadline = loop.time() + self.timeout
        # calls stop this far before the request's own deadline, so the run can still conclude
        self.margin = min(1.0, self.timeout * 0.1)
        self.started = time.perf_counter()

    # -- the run --------------------------------------------------------------
    async def execute(self) -> ProviderReply:
        """Run rounds until the arbiter is confident enough or the rounds run out."""
        system, history, new_input = split_messages(self.call.messages)
        await self._trace({"event": "start", "consortium": self.name, "model": self.call.model,
                           "request_id": self.request.get("request_id"),
                           "response_id": self.request.get("response_id"),
                           "conversation_id": self.request.get("conversation_id"),
                           "agent_id": self.request.get("agent_id"), "definition": self.definition.to_record(),
                           "history_messages": len(history), "new_input": new_input})
        run = _Rounds(with_member_system(self.call.messages, self.definition.system), system, history, new_input)
        try:
            for iteration in range(1, self.definition.max_iterations + 1):
                if await self._round(iteration, run):
                    break
        except asyncio.CancelledError:
            await self._conclude({"status": "cancelled"})
            raise
        except KsiError as failure:
            await self._conclude({"status": "failed", "code": failure.code, "message": failure.message,
                                  "details": failure.details})
            raise
        except Exception as exc:
            await self._conclude({"status": "failed", "code": ErrorCode.INTERNAL_ERROR,
                                  "message": f"internal error: {type(exc).__name__}"})
            raise
        return await self._answer(run)

    async def _round(self, iteration: int, run: _Rounds) -> bool:
        """One round: every member answers, the arbiter judges; True when the run is done."""
        refinement = refinement_turns(run.judged[-1]) if run.judged else []
        inputs = run.new_input + refinement[1:]  # a member's raw input: the new input (+ the refine request)
        # a task group, not gather: cancelled, gather returns as soon as one member has
        # stopped, leaving the others to log their calls after the run has ended
        async with asyncio.TaskGroup() as members:
            calls = [members.create_task(self._member(model, instance, iteration, run.member_base + refinement,
                                                      inputs))
                     for model, instance in self.definition.instances()]
        outcomes = [call.result() for call in calls]
        answers = [MemberAnswer(number, o.model, o.instance, o.content)
                   for number, o in enumerate((o for o in outcomes if o.ok), start=1)]
        failed = sum(not o.ok for o in outcomes)
        if not answers:
            if not run.judged:
                raise self._none_answered([o for o in outcomes if not o.ok])
            run.fallback = {"reason": "members_failed", "iteration": iteration,
                            "message": "no member answered this round; the previous round's answer stands"}
            await self._trace({"event": "iteration", "iteration": iteration, "answered": 0,
                               "failed": failed, "done": True, "reason": "members_failed"})
            return True
        run.rounds.append(answers)
        arbiter = await self._arbiter(iteration, run.system, run.history, run.new_input, answers, run.judged)
        if not arbiter.ok:
            chosen = self._best_ranked(run.judged, run.rounds)
            run.fallback = {"reason": "arbiter_failed", "iteration": iteration, "code": arbiter.code,
                            "message": arbiter.message, "used": chosen[0]}
            run.judged.append(Judged(iteration, chosen[1], 0.0))
            await self._trace({"event": "iteration", "iteration": iteration, "answered": len(answers),
                               "failed": failed, "confidence": 0.0, "done": True, "reason": "arbiter_failed"})
            return True
        return await self._judged(iteration, run, arbiter, answers, failed)

    async def _judged(self, iteration: int, run: _Rounds, arbiter: Outcome, answers: list[MemberAnswer],
                      failed: int) -> bool:
        """The arbiter's verdict on a round read and traced; True when it ends the run."""
        d = self.definition
        verdict_round, parse_now = await self._judge(iteration, arbiter, answers)
        run.judged.append(verdict_round)
        if parse_now == "fallback":
            run.parse = "fallback"
        confident = verdict_round.confidence >= d.confidence_threshold
        done = (confident and iteration >= d.min_iterations) or iteration == d.max_iterations
        reason = ("confident" if confident and iteration >= d.min_iterations else
                  "max_iterations" if iteration == d.max_iterations else
                  "min_iterations" if confident else "below_threshold")
        await self._trace({"event": "iteration", "iteration": iteration, "answered": len(answers),
                           "failed": failed, "confidence": verdict_round.confidence,
                           "threshold": d.confidence_threshold, "done": done, "reason": reason})
        return done

    async def _answer(self, run: _Rounds) -> ProviderReply:
        """The last verdict's synthesis as the run's reply, concluded in its trace."""
        final = run.judged[-1]
        summary = {"name": self.name, "run_id": self.run_id, "iterations": len(run.judged),
                   "confidence": final.confidence, "dissent": final.dissent, "judging": self.definition.judging,
                   "arbiter_parse": run.parse,
                   "members_answered": len(run.rounds[-1]) if run.rounds else 0, "calls": self.calls}
        if run.fallback:
            summary["fallback"] = run.fallback
        await self._conclude({"status": "ok", "content": final.synthesis, **summary}, durable=True)
        if self.call.on_chunk is not None:
            self.call.on_chunk(final.synthesis)  # a consortium answers whole: one chunk
        return ProviderReply(
            content=final.synthesis, model=self.call.model, finish_reason="stop", usage=dict(self.usage),
            cost=self.cost, provider="consortium", provider_response_id=self.run_id,
            extra={"run_id": self.run_id, "consortium": summary},
        )

    def _none_answered(self, failures: list[Outcome]) -> ProviderFailure:
        return ProviderFailure(
            ErrorCode.PROVIDER_ERROR, f"no member of consortium {self.name} answered", retryable=False,
            run_id=self.run_id,
            failures=[{"model": o.model, "instance": o.instance, "code": o.code, "message": o.message}
                      for o in failures],
        )

    @staticmethod
    def _best_ranked(judged: list[Judged], rounds: list[list[MemberAnswer]]) -> tuple[dict[str, Any], str]:
        """The best-ranked member answer of the latest ranked round, else this round's first."""
        for verdict in reversed(judged):
            answers = rounds[verdict.iteration - 1]
            for number in verdict.ranking:
                if 1 <= number <= len(answers):
                    chosen = answers[number - 1]
                    return {"iteration": verdict.iteration, "answer": number, "model": chosen.model}, chosen.content
        first = rounds[-1][0]
        return {"iteration": len(rounds), "answer": 1, "model": first.model}, first.content

    async def _judge(self, iteration: int, arbiter: Outcome, answers: list[MemberAnswer]) -> tuple[Judged, str]:
        reading = read_verdict(arbiter.content)
        verdict = reading.verdict
        ranking = [n for n in verdict.ranking if 1 <= n <= len(answers)]
        note = None
        if self.definition.judging == "rank":
            if ranking:
                chosen = ranking[0]
            else:
                chosen = 1
                note = "no usable ranking; the first member answer is used"
            text = answers[chosen - 1].content
        else:
            chosen = None
            text = verdict.synthesis
            if not text.strip():
                chosen = ranking[0] if ranking else 1
                text = answers[chosen - 1].content
                note = f"empty synthesis; member answer {chosen} is used"
        judged = Judged(iteration, text, verdict.confidence, ranking, verdict.refinement_areas, verdict.dissent,
                        verdict.needs_iteration)
        line = {**arbiter.trace(), "arbiter_parse": reading.parse, "confidence": verdict.confidence,
                "synthesis": verdict.synthesis, "dissent": verdict.dissent,
                "refinement_areas": verdict.refinement_areas, "needs_iteration": verdict.needs_iteration,
                "ranking": verdict.ranking, "answers": [{"answer": a.number, "model": a.model,
                                                        "instance": a.instance} for a in answers]}
        if chosen is not None:
            line["chosen"] = chosen
        if reading.problem:
            line["parse_problem"] = reading.problem
            line["raw"] = arbiter.content
        if note:
            line["note"] = note
        await self._trace(line)
        return judged, reading.parse

    # -- calls ----------------------------------------------------------------
    async def _member(self, model: str, instance: int, iteration: int, messages: list[dict[str, Any]],
                      inputs: list[dict[str, Any]]) -> Outcome:
        outcome = await self._call("member", model, instance, iteration, messages, inputs,
                                   self.definition.timeout or self.timeout)
        await self._trace(outcome.trace())
        return outcome

    async def _arbiter(self, iteration: int, system: str | None, history: list[dict[str, Any]],
                       new_input: list[dict[str, Any]], answers: list[MemberAnswer], judged: list[Judged]) -> Outcome:
        messages = arbiter_messages(history, system, new_input, answers, judged, self.definition.judging)
        # the arbiter's trace line is written with its verdict (see _judge) or here when it failed
        outcome = await self._call("arbiter", self.definition.arbiter, 1, iteration, messages, messages[-1:],
                                   self.timeout)
        if not outcome.ok:
            await self._trace(outcome.trace())
        return outcome

    async def _call(self, role: str, model: str, instance: int, iteration: int, messages: list[dict[str, Any]],
                    inputs: list[dict[str, Any]], timeout: float) -> Outcome:
        """One model call with the daemon's retry policy, logged as its own response file."""
        outcome = Outcome(role, model, instance, iteration, new_response_id(model))
        provider_call = ProviderCall(model=model, messages=messages, temperature=self.call.temperature,
                                     max_tokens=self.call.max_tokens, options=dict(self.call.options))
        started = time.perf_counter()
        allowed = timeout
        try:
            async with self.parts.slot(model):
                # never past the request's own deadline, so a slow call cannot take the run down with it
                allowed = min(timeout, self.deadline - asyncio.get_running_loop().time() - self.margin)
                if allowed <= 0:
                    raise ProviderFailure(ErrorCode.TIMEOUT, "no time left in the request's timeout")
                provider_call.timeout = allowed
                reply = await asyncio.wait_for(
                    with_retries(lambda: self.parts.provider.complete(provider_call), self.parts.retry,
                                 self.parts.breaker, self.parts.circuit(model, provider_call.options),
                                 outcome.attempts),
                    allowed)
        except TimeoutError:
            outcome.code, outcome.message = ErrorCode.TIMEOUT, f"no answer within {round(allowed, 3)}s"
        except asyncio.CancelledError:
            outcome.code, outcome.message = ErrorCode.CANCELLED, "the consortium run was cancelled"
            outcome.duration_ms = _ms(started)
            await to_the_end(self._log_call(outcome, inputs))
            raise
        except KsiError as error:
            outcome.code, outcome.message, outcome.details = error.code, error.message, dict(error.details)
        except Exception as exc:
            log.exception("consortium_call_failed", run_id=self.run_id, model=model, role=role)
            outcome.code, outcome.message = ErrorCode.INTERNAL_ERROR, f"internal error: {type(exc).__name__}"
        else:
            outcome.ok = True
            outcome.content = reply.content
            outcome.usage = dict(reply.usage)
            outcome.cost = reply.cost
            outcome.finish_reason = reply.finish_reason
            self._add_usage(reply)
        outcome.duration_ms = _ms(started)
        await self._log_call(outcome, inputs)
        return outcome

    def _add_usage(self, reply: ProviderReply) -> None:
        self.calls += 1
        for key in USAGE_KEYS:
            self.usage[key] += int(reply.usage.get(key, 0) or 0)
        if reply.cost is not None:
            self.cost = (self.cost or 0.0) + reply.cost

    # -- files ----------------------------------------------------------------
    def _ids(self, outcome: Outcome | None = None) -> dict[str, Any]:
        ids: dict[str, Any] = {"run_id": self.run_id, "consortium": self.name,
                               "request_id": self.request.get("request_id"),
                               "conversation_id": self.request.get("conversation_id")}
        if self.request.get("agent_id"):
            ids["agent_id"] = self.request["agent_id"]
        if outcome is not None:
            ids.update(role=outcome.role, iteration=outcome.iteration, instance=outcome.instance)
        return ids

    async def _log_call(self, outcome: Outcome, inputs: list[dict[str, Any]]) -> None:
        """responses/{model-slug}-{hex}.jsonl: linked to the conversation, never in its index."""
        ts = utc_now()
        ids = self._ids(outcome)
        lines = [message_line("user" if m.get("role") != "system" else "system", m.get("content"), ts, **ids)
                 for m in inputs]
        common = {"duration_ms": outcome.duration_ms, "attempts": outcome.attempts, "ts": utc_now(), **ids}
        if outcome.ok:
            end = answer_line([message("assistant", outcome.content)], {
                "model": outcome.model, "provider": outcome.model.split("/", 1)[0], "usage": outcome.usage,
                "cost": outcome.cost, "finish_reason": outcome.finish_reason, **common})
        else:
            end = error_line(outcome.code, outcome.message, outcome.details, {"model": outcome.model, **common})
        try:
            await self.parts.responses.write(outcome.response_id, [*lines, end])
        except Exception:
            log.exception("consortium_call_log_failed", run_id=self.run_id, response_id=outcome.response_id)

    async def _trace(self, record: dict[str, Any], durable: bool = False) -> None:
        line = {"v": 1, "ts": utc_now(), "run_id": self.run_id, **record}
        try:
            async with self._trace_lock:
                await self.parts.traces.append(self.run_id, line, durable)
        except Exception:
            log.exception("consortium_trace_failed", run_id=self.run_id)

    async def _conclude(self, record: dict[str, Any], durable: bool = False) -> None:
        usage = {"usage": dict(self.usage), "cost": self.cost, "calls": self.calls}
        await to_the_end(self._trace({"event": "final", **record, **usage,
                                      "duration_ms": _ms(self.started)}, durable))


def _ms(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 2)
