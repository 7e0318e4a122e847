"""An open circuit asks its probe (a TCP connect) whether the provider answers again: one probe at
a time per circuit, at most once per interval, its answer shared by every request meanwhile."""

from __future__ import annotations

import asyncio

import pytest

from ksi_daemon.providers.base import ProviderFailure
from ksi_daemon.services.resilience import PROBE_INTERVAL, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class SlowProbe:
    """A probe whose answer is held until released; counts how often it was asked."""

    def __init__(self) -> None:
        self.asked = 0
        self.release = asyncio.Event()
        self.answer = False

    async def __call__(self) -> bool:
        self.asked += 1
        await self.release.wait()
        return self.answer


async def test_an_open_circuit_probes_once_for_many_requests_and_once_per_interval() -> None:
    clock = Clock()
    breaker = CircuitBreaker(threshold=1, reset=30.0, clock=clock)
    probe = SlowProbe()
    assert breaker.failure("p", probe)  # opened
    checks = [asyncio.ensure_future(breaker.check("p")) for _ in range(20)]
    await asyncio.sleep(0)
    probe.release.set()
    outcomes = await asyncio.gather(*checks, return_exceptions=True)
    assert probe.asked == 1
    assert all(isinstance(o, ProviderFailure) and o.code == "provider_unavailable" for o in outcomes)
    for _ in range(5):  # within the interval: the kept answer, no new connection
        with pytest.raises(ProviderFailure):
            await breaker.check("p")
    assert probe.asked == 1
    probe.answer = True
    clock.now += PROBE_INTERVAL
    await breaker.check("p")  # asked again: it answers, the circuit lets the call through
    assert probe.asked == 2
    assert breaker.report()["p"]["state"] == "closed"


async def test_a_request_cancelled_while_the_probe_runs_leaves_it_to_the_others() -> None:
    breaker = CircuitBreaker(threshold=1, reset=30.0, clock=Clock())
    probe = SlowProbe()
    probe.answer = True
    breaker.failure("p", probe)
    first = asyncio.ensure_future(breaker.check("p"))
    second = asyncio.ensure_future(breaker.check("p"))
    await asyncio.sleep(0)
    first.cancel()
    probe.release.set()
    await second  # the shared probe went on and said yes
    assert first.cancelled() and probe.asked == 1
