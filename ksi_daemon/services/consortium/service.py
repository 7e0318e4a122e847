"""`consortium:*` events and the answerer of `consortium/...` models: saved definitions, runs
that answer inside the asking conversation, and their traces."""

from __future__ import annotations

from typing import Any

import structlog
from pydantic import ValidationError

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.events import CONSORTIUM_LIST, CONSORTIUM_REMOVE, CONSORTIUM_RUNS, CONSORTIUM_SAVE, CONSORTIUM_TRACE
from ksi_common.ids import is_safe_id, new_id
from ksi_common.settings import Settings
from ksi_daemon.context import EventContext
from ksi_daemon.events import NoData
from ksi_daemon.providers.base import ModelAbilities, Provider, ProviderCall, ProviderReply
from ksi_daemon.providers.options import circuit_key
from ksi_daemon.router import Router, Unregister
from ksi_daemon.services.consortium.models import (
    CONSORTIUM_PREFIX,
    INLINE_NAME,
    ConsortiumDefinition,
    ConsortiumRef,
    ConsortiumRuns,
    ConsortiumSave,
    ConsortiumTrace,
    parse_definition,
)
from ksi_daemon.services.consortium.run import ConsortiumRun, RunParts
from ksi_daemon.services.limits import ConcurrencyLimits
from ksi_daemon.services.resilience import CircuitBreaker, RetryPolicy
from ksi_daemon.storage.ports import ConsortiumStore, ResponseStore, TraceStore

log = structlog.get_logger("ksi.consortium")


class ConsortiumService:
    """Answers `consortium/NAME` (and inline) models for the completion service."""

    # as a provider: a run is no single model; its member and arbiter calls take the slots
    keeps_session = False
    takes_slot = False
    calibrated = False

    def __init__(
        self,
        settings: Settings,
        router: Router,
        store: ConsortiumStore,
        traces: TraceStore,
        responses: ResponseStore,
        provider: Provider,
        limits: ConcurrencyLimits,
        breaker: CircuitBreaker,
        retry: RetryPolicy | None = None,
    ) -> None:
        self.settings = settings
        self.router = router
        self.store = store
        self.traces = traces
        self.definitions: dict[str, ConsortiumDefinition] = {}
        # member and arbiter calls count on the completions' circuits, keyed by model and endpoint:
        # one failing member model does not silence its siblings from the same provider
        self.parts = RunParts(
            provider=provider, responses=responses, traces=traces,
            retry=retry or RetryPolicy(settings.retry_attempts, settings.retry_base_delay, settings.retry_max_delay),
            breaker=breaker, circuit=lambda model, options: circuit_key(model, settings.model_settings(model).api_base,
                                                                        options),
            slot=limits.slot, default_timeout=settings.request_timeout,  # the completions' own limits
        )
        self.active = 0
        self.runs = 0
        self._ended: dict[str, dict[str, Any]] = {}  # run id -> the listing line of a run that ended (it no longer changes)

    def register(self) -> list[Unregister]:
        r = self.router
        return [
            r.register(CONSORTIUM_SAVE, self.handle_save, ConsortiumSave,
                       "Save a consortium definition; use it as model consortium/NAME."),
            r.register(CONSORTIUM_LIST, self.handle_list, NoData, "Every saved consortium definition."),
            r.register(CONSORTIUM_REMOVE, self.handle_remove, ConsortiumRef, "Remove a saved consortium."),
            r.register(CONSORTIUM_TRACE, self.handle_trace, ConsortiumTrace,
                       "The trace of one consortium run: members, answers, verdicts, iterations, usage."),
            r.register(CONSORTIUM_RUNS, self.handle_runs, ConsortiumRuns,
                       "Consortium runs, newest first: consortium, outcome, confidence, conversation, cost."),
        ]

    async def start(self) -> None:
        for name, record in (await self.store.load_all()).items():
            definition = self._from_record(name, record)
            if definition is not None:
                self.definitions[name] = definition

    def health(self) -> dict[str, Any]:
        return {"saved": len(self.definitions), "runs_active": self.active, "runs": self.runs}

    # -- events ---------------------------------------------------------------
    async def handle_save(self, data: ConsortiumSave, _context: EventContext) -> dict[str, Any]:
        definition = ConsortiumDefinition.model_validate(data.model_dump(exclude={"name"}))
        record, replaced = await self.store.save(data.name, definition.to_record())
        replaced = replaced or data.name in self.definitions
        self.definitions[data.name] = definition
        return {"name": data.name, "model": CONSORTIUM_PREFIX + data.name, "replaced": replaced,
                "definition": record}

    async def handle_list(self, _data: NoData, _context: EventContext) -> dict[str, Any]:
        records = await self.store.load_all()
        consortia = [{**record, "name": name, "model": CONSORTIUM_PREFIX + name} for name, record in records.items()]
        return {"consortia": consortia, "count": len(consortia)}

    async def handle_remove(self, data: ConsortiumRef, _context: EventContext) -> dict[str, Any]:
        removed = await self.store.remove(data.name)
        self.definitions.pop(data.name, None)
        if not removed:
            raise self._not_found(data.name)
        return {"name": data.name, "removed": True}

    async def handle_trace(self, data: ConsortiumTrace, _context: EventContext) -> dict[str, Any]:
        lines = await self.traces.read(data.run_id)
        if lines is None:
            # a run belongs to one completion request; its absence is reported like an unknown request
            raise KsiError(ErrorCode.REQUEST_NOT_FOUND, f"no consortium run {data.run_id}", run_id=data.run_id)
        return summarize(data.run_id, lines)

    async def handle_runs(self, data: ConsortiumRuns, _context: EventContext) -> dict[str, Any]:
        runs = []
        run_ids = await self.traces.run_ids()
        # only runs that still have a trace are remembered: one entry per run would grow forever
        self._ended = {run_id: self._ended[run_id] for run_id in run_ids if run_id in self._ended}
        for run_id in run_ids:
            line = self._ended.get(run_id)
            if line is None:
                lines = await self.traces.read(run_id)
                if lines is None:
                    continue  # removed since it was listed
                line = listing_line(summarize(run_id, lines))
                if line["status"] != "running":
                    self._ended[run_id] = line
            runs.append(line)
        runs.sort(key=lambda run: (run["started"] or "", run["run_id"]), reverse=True)
        return {"runs": runs[data.offset:data.offset + data.limit], "total": len(runs),
                "limit": data.limit, "offset": data.offset}

    # -- the answerer ---------------------------------------------------------
    async def check(self, model: str, inline: dict[str, Any] | None) -> None:
        """Fail a request's ack when its consortium is unknown or its inline definition invalid."""
        await self.resolve(model, inline)

    async def resolve(self, model: str, inline: dict[str, Any] | None) -> tuple[str, ConsortiumDefinition]:
        if inline is not None:
            return INLINE_NAME, parse_definition(inline)
        name = model[len(CONSORTIUM_PREFIX):] if model.startswith(CONSORTIUM_PREFIX) else model
        if not is_safe_id(name):
            raise KsiError(ErrorCode.VALIDATION_ERROR, f"model {model!r}: a consortium name must match "
                           "[A-Za-z0-9][A-Za-z0-9_.-]{0,127} without '..'", fields={"model": "invalid consortium name"})
        definition = self.definitions.get(name)
        if definition is None:  # saved by hand, or by another tool, since the daemon started
            record = await self.store.load(name)
            definition = self._from_record(name, record) if record is not None else None
            if definition is None:
                raise self._not_found(name, inline_hint=name == INLINE_NAME)
            self.definitions[name] = definition
        return name, definition

    async def abilities(self, model: str) -> ModelAbilities:
        # no member's tool call reaches the client, and traces, member files and the arbiter's
        # prompt hold text only; options go to every member as they are
        return ModelAbilities(function_calling=False, vision=False, pdf_input=False,
                              because="is a consortium, whose members answer")

    async def complete(self, call: ProviderCall) -> ProviderReply:
        """Run the consortium on the conversation's rebuilt messages and return its one answer."""
        name, definition = await self.resolve(call.model, call.request.get("consortium"))
        run = ConsortiumRun(new_id("run-", 16), name, definition, call, self.parts)
        self.active += 1
        self.runs += 1
        try:
            return await run.execute()
        finally:
            self.active -= 1

    # -- helpers --------------------------------------------------------------
    @staticmethod
    def _from_record(name: str, record: dict[str, Any]) -> ConsortiumDefinition | None:
        fields = {key: record[key] for key in ConsortiumDefinition.model_fields if key in record}
        try:
            return ConsortiumDefinition.model_validate(fields)
        except ValidationError:
            log.warning("consortium_definition_invalid", name=name)
            return None

    @staticmethod
    def _not_found(name: str, inline_hint: bool = False) -> KsiError:
        message = f"no consortium {name}"
        if inline_hint:
            message += ("; consortium/inline needs the `consortium` definition on every request "
                        "(save it with consortium:save to use it by name)")
        return KsiError(ErrorCode.CONSORTIUM_NOT_FOUND, message, name=name)


def summarize(run_id: str, lines: list[dict[str, Any]]) -> dict[str, Any]:
    """A trace as its raw events plus the rounds grouped: members, verdict and outcome of each."""
    start = next((line for line in lines if line.get("event") == "start"), {})
    final = next((line for line in reversed(lines) if line.get("event") == "final"), None)
    rounds: dict[int, dict[str, Any]] = {}
    for line in lines:
        iteration = line.get("iteration")
        if not isinstance(iteration, int):
            continue
        entry = rounds.setdefault(iteration, {"iteration": iteration, "members": [], "arbiter": None,
                                              "outcome": None})
        kind = line.get("event")
        if kind == "member":
            entry["members"].append(line)
        elif kind == "arbiter":
            entry["arbiter"] = line
        elif kind == "iteration":
            entry["outcome"] = line
    ordered = [rounds[k] for k in sorted(rounds)]
    return {
        "run_id": run_id,
        "started": start.get("ts"),
        "outcome": outcome_of(final, ordered),
        "consortium": start.get("consortium"),
        "model": start.get("model"),
        "request_id": start.get("request_id"),
        "conversation_id": start.get("conversation_id"),
        "definition": start.get("definition"),
        "status": final.get("status") if final else "running",
        "final": final,
        "iterations": ordered,
        "events": lines,
    }


def outcome_of(final: dict[str, Any] | None, rounds: list[dict[str, Any]]) -> str:
    """How the run ended, in one word: `status` says only that an answer came back (`ok`), which
    a run whose last verdict stayed below its threshold, or whose arbiter failed, also does."""
    if final is None:
        return "running"
    if final.get("status") != "ok":
        return str(final.get("status"))
    fallback = final.get("fallback") or {}
    if fallback.get("reason"):
        return str(fallback["reason"])  # members_failed or arbiter_failed: an earlier answer stands
    last = next((r["outcome"] for r in reversed(rounds) if r["outcome"]), None) or {}
    threshold = last.get("threshold")
    confidence = last.get("confidence", final.get("confidence"))
    if isinstance(threshold, int | float) and isinstance(confidence, int | float) and confidence < threshold:
        return "below_threshold"
    return "confident"


def listing_line(run: dict[str, Any]) -> dict[str, Any]:
    """A run as `consortium:runs` lists it: the trace's summary without its rounds and events."""
    final = run["final"] or {}
    last = next((r["outcome"] for r in reversed(run["iterations"]) if r["outcome"]), None) or {}
    return {"run_id": run["run_id"], "consortium": run["consortium"], "status": run["status"],
            "outcome": run["outcome"], "started": run["started"], "conversation_id": run["conversation_id"],
            "request_id": run["request_id"], "confidence": final.get("confidence", last.get("confidence")),
            "threshold": last.get("threshold"), "iterations": len(run["iterations"]),
            "calls": final.get("calls"), "cost": final.get("cost"), "duration_ms": final.get("duration_ms"),
            "code": final.get("code")}
