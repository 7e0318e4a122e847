"""The scheduler's offers, word by word: a job offered to the pool while it waits for a slot, whose
slot frees while the pool is told of a claim or a cancel arrives. Whatever the order, the job ends
one way only (run here, handed over, or cancelled) and the conversation's worker goes on.

The pool's requests are a fake here (the database is what is around the scheduler); the real
pool runs the same words in test_pool_offers and test_pool_stealing."""

from __future__ import annotations

import asyncio
from typing import Any

from ksi_daemon.services.completion.scheduler import Job, Scheduler
from ksi_daemon.services.limits import ConcurrencyLimits
from ksi_daemon.storage.ports import OneDaemonRequests


class HeldWithdrawals(OneDaemonRequests):
    """Offers are taken; the first `withdraw` after a slot freed waits until the test answers it."""

    def __init__(self) -> None:
        self.offers: list[str] = []
        self.asked = asyncio.Event()  # a withdraw is waiting for its answer
        self.answer: asyncio.Future[bool] | None = None

    async def offer(self, request_id: str) -> bool:
        self.offers.append(request_id)
        return True

    async def withdraw(self, request_id: str) -> bool:
        self.answer = asyncio.get_running_loop().create_future()
        self.asked.set()
        return await self.answer


class Outcomes:
    def __init__(self) -> None:
        self.ran: list[str] = []
        self.ended: dict[str, str] = {}
        self.release = asyncio.Event()

    def job(self, ticket: str, hold: bool = False) -> Job:
        async def run() -> None:
            self.ran.append(ticket)
            if hold:
                await self.release.wait()
            self.ended[ticket] = "done"

        def ended(how: str) -> Any:
            return lambda: self.ended.setdefault(ticket, how)

        return Job(key=f"conv-{ticket}", model="m", run=run, on_cancel_queued=ended("cancelled"), ticket=ticket,
                   on_taken_over=ended("handed_over"))


async def offered_while_the_slot_is_held() -> tuple[Scheduler, HeldWithdrawals, Outcomes, Job]:
    """Job `b` offered while `a` holds the one slot; then `a` ends and `b`'s offer is being taken back."""
    pool = HeldWithdrawals()
    scheduler = Scheduler(ConcurrencyLimits(1, lambda _model: None), offers=pool)
    outcomes = Outcomes()
    scheduler.submit(outcomes.job("a", hold=True))
    while outcomes.ran != ["a"]:
        await asyncio.sleep(0)
    offered = outcomes.job("b")
    scheduler.submit(offered)
    while pool.offers != ["b"]:
        await asyncio.sleep(0)
    outcomes.release.set()  # `a` ends: `b` gets the slot and takes its offer back
    await asyncio.wait_for(pool.asked.wait(), 10)
    return scheduler, pool, outcomes, offered


async def ended(outcomes: Outcomes, ticket: str) -> str:
    for _ in range(1000):
        if ticket in outcomes.ended:
            return outcomes.ended[ticket]
        await asyncio.sleep(0.01)
    raise AssertionError(f"job {ticket} never ended: {outcomes.ended}")


async def test_a_claim_heard_while_the_offer_is_taken_back_hands_the_job_over() -> None:
    scheduler, pool, outcomes, _offered = await offered_while_the_slot_is_held()
    scheduler.claimed("b")  # the claim's word arrives while the offer is being taken back
    await asyncio.sleep(0)
    assert pool.answer is not None
    pool.answer.set_result(False)  # the database says it was claimed
    assert await ended(outcomes, "b") == "handed_over"
    assert outcomes.ran == ["a"]
    assert scheduler.queued == 0 and scheduler.active_conversations == 0


async def test_a_claim_heard_late_about_an_offer_taken_back_runs_the_job_here() -> None:
    scheduler, pool, outcomes, _offered = await offered_while_the_slot_is_held()
    scheduler.claimed("b")  # a late word: the database says the offer was this daemon's to take back
    await asyncio.sleep(0)
    assert pool.answer is not None
    pool.answer.set_result(True)
    assert await ended(outcomes, "b") == "done"
    assert outcomes.ran == ["a", "b"]


async def test_a_cancel_while_the_offer_is_taken_back_cancels_the_job_once_it_is_back() -> None:
    scheduler, pool, outcomes, offered = await offered_while_the_slot_is_held()
    assert scheduler.cancel(offered)
    await asyncio.sleep(0)
    assert pool.answer is not None
    pool.answer.set_result(True)
    assert await ended(outcomes, "b") == "cancelled"
    assert outcomes.ran == ["a"]
    assert scheduler.queued == 0


async def test_a_cancel_while_the_offer_is_taken_back_but_claimed_hands_it_over() -> None:
    scheduler, pool, outcomes, offered = await offered_while_the_slot_is_held()
    assert scheduler.cancel(offered)
    await asyncio.sleep(0)
    assert pool.answer is not None
    pool.answer.set_result(False)  # claimed first: the cancel is the claimer's to answer
    assert await ended(outcomes, "b") == "handed_over"
    assert outcomes.ran == ["a"]
