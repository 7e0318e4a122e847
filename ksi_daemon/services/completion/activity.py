"""What completions did since the daemon started: per model counts, and the latest failures.

The circuits only count failures a retry could cure; a refused model or a bad request leaves
them closed. These counts see every outcome, so health can say that requests are failing the
moment the first one does, whichever door asks.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

RECENT_ERRORS = 20
MESSAGE_CHARS = 300
MODELS_KEPT = 256  # model names come from requests: the most recently used are counted, the rest forgotten


@dataclass(slots=True)
class ModelActivity:
    requests: int = 0
    succeeded: int = 0
    failed: int = 0
    cancelled: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    cache_read: int = 0  # prompt tokens the provider read from its cache
    cost: float = 0.0
    latency_ms_total: float = 0.0  # of the succeeded requests: queue wait excluded, retries included
    latency_ms_last: float | None = None
    last_outcome: str | None = None  # "ok", or the error code of the latest request that ended
    last_at: str | None = None

    def report(self) -> dict[str, Any]:
        return {
            "requests": self.requests, "succeeded": self.succeeded, "failed": self.failed,
            "cancelled": self.cancelled, "tokens_in": self.tokens_in, "tokens_out": self.tokens_out,
            "cache_read": self.cache_read,
            "cache_hit_rate": round(self.cache_read / self.tokens_in, 4) if self.tokens_in else None,
            "cost": round(self.cost, 10),
            "latency_ms_mean": round(self.latency_ms_total / self.succeeded, 1) if self.succeeded else None,
            "latency_ms_last": None if self.latency_ms_last is None else round(self.latency_ms_last, 1),
            "last_outcome": self.last_outcome, "last_at": self.last_at,
        }


class CompletionActivity:
    """Counts fed by the completion service as each request ends (never by a door)."""

    def __init__(self, recent: int = RECENT_ERRORS) -> None:
        self.models: OrderedDict[str, ModelActivity] = OrderedDict()  # least recently used first
        self.errors: deque[dict[str, Any]] = deque(maxlen=recent)
        self.failing: set[str] = set()  # models whose latest request failed (a cancel says nothing either way)

    def _of(self, model: str) -> ModelActivity:
        found = self.models.get(model)
        if found is None:
            found = self.models[model] = ModelActivity()
            while len(self.models) > MODELS_KEPT:
                forgotten, _counts = self.models.popitem(last=False)
                self.failing.discard(forgotten)
        else:
            self.models.move_to_end(model)
        return found

    def succeeded(self, model: str, duration_ms: float, usage: dict[str, Any], cost: float | None,
                  ts: str) -> None:
        counts = self._of(model)
        counts.last_outcome, counts.last_at = "ok", ts
        self.failing.discard(model)
        counts.requests += 1
        counts.succeeded += 1
        counts.tokens_in += int(usage.get("prompt_tokens") or 0)
        counts.tokens_out += int(usage.get("completion_tokens") or 0)
        counts.cache_read += int(usage.get("cache_read_input_tokens") or 0)
        counts.cost += cost or 0.0
        counts.latency_ms_total += duration_ms
        counts.latency_ms_last = duration_ms

    def failed(self, model: str, code: str, message: str, ts: str, request_id: str,
               conversation_id: str | None) -> None:
        counts = self._of(model)
        counts.last_outcome, counts.last_at = code, ts
        self.failing.add(model)
        counts.requests += 1
        counts.failed += 1
        self.errors.appendleft({"ts": ts, "code": code, "model": model, "message": message[:MESSAGE_CHARS],
                                "request_id": request_id, "conversation_id": conversation_id})

    def cancelled(self, model: str) -> None:
        counts = self._of(model)
        counts.requests += 1
        counts.cancelled += 1

    def report(self) -> dict[str, Any]:
        """`since_start`: counts per model; `recent_errors`: the latest failures, newest first;
        `failing`: the models whose latest request failed. Cheap while nothing ran: every
        `system:health` round trip builds it."""
        if not self.models:
            return {"since_start": {}, "recent_errors": [], "failing": []}
        return {"since_start": {model: counts.report() for model, counts in self.models.items()},
                "recent_errors": list(self.errors), "failing": sorted(self.failing)}
