"""The daemon's own retry policy and a per-provider circuit breaker."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import structlog

from ksi_common.errors import ErrorCode
from ksi_daemon.providers.base import Probe, ProviderFailure

T = TypeVar("T")
log = structlog.get_logger("ksi.resilience")


@dataclass(slots=True)
class RetryPolicy:
    attempts: int
    base_delay: float
    max_delay: float

    def delay(self, attempt: int, retry_after: float | None) -> float:
        """Exponential backoff with jitter; a provider's Retry-After wins when it is given."""
        if retry_after is not None:
            return retry_after
        ceiling = min(self.max_delay, self.base_delay * 2 ** (attempt - 1))
        return random.uniform(ceiling / 2, ceiling)


@dataclass(slots=True)
class Circuit:
    failures: int = 0
    opened_at: float | None = None
    trips: int = 0
    # how to ask whether the provider answers again (a local server that was not up yet), from
    # the last failure that could tell; an open circuit closes as soon as it says yes
    probe: Probe | None = None
    # its last answer and when it was asked (by the breaker's clock): every request sees it
    # for PROBE_INTERVAL instead of connecting again; `probing` while one is under way
    answered: bool = False
    probed_at: float | None = None
    probing: asyncio.Future[bool] | None = None


# an open circuit's probe runs at most once in this many seconds, shared by all its requests
PROBE_INTERVAL = 1.0


@dataclass
class CircuitBreaker:
    """Opens after `threshold` consecutive failures; lets one call through after `reset` seconds."""

    threshold: int
    reset: float
    clock: Callable[[], float] = time.monotonic
    circuits: dict[str, Circuit] = field(default_factory=dict)

    async def check(self, key: str) -> None:
        circuit = self.circuits.get(key)
        if circuit is None or circuit.opened_at is None:
            return
        waited = self.clock() - circuit.opened_at
        if waited < self.reset and not await self._answers_again(circuit):
            raise ProviderFailure(
                ErrorCode.PROVIDER_UNAVAILABLE,
                f"provider {key} is failing; circuit open for another {self.reset - waited:.1f}s",
                provider=key, retry_after=round(self.reset - waited, 3),
            )
        # half-open: let this call probe; one more failure re-opens at once
        circuit.opened_at = None
        circuit.failures = self.threshold - 1

    async def _answers_again(self, circuit: Circuit) -> bool:
        """The circuit's probe, one at a time and at most once per PROBE_INTERVAL: a probe under
        way is awaited by every request that comes meanwhile, its answer kept on the circuit."""
        if circuit.probe is None:
            return False
        if circuit.probing is None:
            if circuit.probed_at is not None and self.clock() - circuit.probed_at < PROBE_INTERVAL:
                return circuit.answered
            circuit.probed_at = self.clock()
            circuit.probing = asyncio.ensure_future(circuit.probe())
            circuit.probing.add_done_callback(lambda done: self._probed(circuit, done))
        # shielded: a request cancelled while waiting does not cancel the others' probe
        return await asyncio.shield(circuit.probing)

    @staticmethod
    def _probed(circuit: Circuit, done: asyncio.Future[bool]) -> None:
        circuit.probing = None
        circuit.answered = not done.cancelled() and done.exception() is None and done.result()

    def success(self, key: str) -> bool:
        """Record a success; True when it closed a circuit that had tripped."""
        circuit = self.circuits.get(key)
        if circuit is None:
            return False
        recovering = circuit.trips > 0 and circuit.failures > 0
        circuit.failures = 0
        circuit.opened_at = None
        return recovering

    def failure(self, key: str, probe: Probe | None = None) -> bool:
        """Record a failure; True when it opened the circuit."""
        circuit = self.circuits.setdefault(key, Circuit())
        circuit.failures += 1
        circuit.probe = probe
        if circuit.failures >= self.threshold and circuit.opened_at is None:
            circuit.opened_at = self.clock()
            circuit.probed_at = None  # an answer from before it opened says nothing now
            circuit.trips += 1
            return True
        return False

    def report(self) -> dict[str, Any]:
        now = self.clock()
        return {
            key: {
                "state": "open" if c.opened_at is not None and now - c.opened_at < self.reset else
                         ("half_open" if c.opened_at is not None else "closed"),
                "consecutive_failures": c.failures,
                "trips": c.trips,
            }
            for key, c in self.circuits.items()
        }


async def with_retries(
    call: Callable[[], Awaitable[T]],
    policy: RetryPolicy,
    breaker: CircuitBreaker,
    key: str,
    attempts_log: list[dict[str, Any]],
    log_fields: dict[str, Any] | None = None,
) -> T:
    """Run `call` under the breaker, retrying retryable failures; every attempt is logged.

    Retries and circuit changes also go to the daemon log with `log_fields` (request,
    conversation, model), so `ksi logs --level warning` shows what went wrong."""
    fields = log_fields or {}
    for attempt in range(1, policy.attempts + 1):
        await breaker.check(key)
        started = time.perf_counter()
        try:
            result = await call()
        except ProviderFailure as failure:
            # a fault of the configuration (unknown model, missing key, bad request) is not retryable
            # and says nothing about the provider's health: only retryable failures count
            counts_against_provider = failure.retryable
            if counts_against_provider and breaker.failure(key, failure.probe):
                log.warning("circuit_opened", provider=key, code=failure.code, reset_seconds=breaker.reset, **fields)
            entry: dict[str, Any] = {
                "attempt": attempt, "ok": False, "code": failure.code, "message": failure.message[:500],
                "duration_ms": round((time.perf_counter() - started) * 1000, 2),
            }
            too_long = failure.retry_after is not None and failure.retry_after > policy.max_delay
            if not failure.retryable or attempt == policy.attempts or too_long:
                attempts_log.append(entry)
                raise
            delay = policy.delay(attempt, failure.retry_after)
            entry["retry_in"] = round(delay, 3)
            attempts_log.append(entry)
            log.warning("completion_retry", code=failure.code, attempt=attempt, retry_in=entry["retry_in"],
                        reason=failure.message[:200], **fields)
            await asyncio.sleep(delay)
            continue
        if breaker.success(key):
            log.warning("circuit_closed", provider=key, **fields)
        attempts_log.append({"attempt": attempt, "ok": True,
                             "duration_ms": round((time.perf_counter() - started) * 1000, 2)})
        return result
    raise AssertionError("unreachable")  # the loop returns or raises
