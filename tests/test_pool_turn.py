"""A pooled turn's states and moves: every move its state allows, every other one refused; and a
claim heard while a cancelled turn's offer is withdrawn, which must leave no job of the
conversation unanswered (it once dropped them all: the claim's word cancelled the worker).

The pool's requests are a fake here; the real pool runs the same words in test_pool_offers."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from ksi_daemon.services.completion.scheduler import Job, Scheduler
from ksi_daemon.services.limits import ConcurrencyLimits
from ksi_daemon.services.pool.turn import IllegalMove, PooledTurn, TurnState
from ksi_daemon.storage.ports import OneDaemonRequests

S = TurnState
MOVE: dict[TurnState, Callable[[PooledTurn], Any]] = {
    S.LINED: PooledTurn.back_in_line, S.WAITING: PooledTurn.wait_for_slot, S.OFFERED: PooledTurn.offer,
    S.CLAIMED: PooledTurn.claim, S.WITHDRAWN: PooledTurn.withdraw, S.RUNNING: PooledTurn.run,
    S.ENDED: PooledTurn.end, S.HANDED_OVER: PooledTurn.hand_over,
}
PATH = {  # the moves that bring a new turn to each state
    S.LINED: [], S.WAITING: [S.WAITING], S.OFFERED: [S.WAITING, S.OFFERED],
    S.CLAIMED: [S.WAITING, S.OFFERED, S.CLAIMED], S.WITHDRAWN: [S.WAITING, S.OFFERED, S.WITHDRAWN],
    S.RUNNING: [S.RUNNING], S.ENDED: [S.ENDED], S.HANDED_OVER: [S.HANDED_OVER],
}
LEGAL = {
    S.LINED: {S.WAITING, S.RUNNING, S.ENDED, S.HANDED_OVER},
    S.WAITING: {S.OFFERED, S.RUNNING, S.ENDED, S.LINED},
    S.OFFERED: {S.CLAIMED, S.WITHDRAWN, S.WAITING, S.HANDED_OVER},
    S.CLAIMED: {S.OFFERED, S.WITHDRAWN, S.WAITING, S.HANDED_OVER},
    S.WITHDRAWN: {S.ENDED, S.HANDED_OVER},
    S.RUNNING: {S.ENDED},
    S.ENDED: set(),
    S.HANDED_OVER: set(),
}


def turn_in(state: TurnState) -> PooledTurn:
    turn = PooledTurn()
    for step in PATH[state]:
        MOVE[step](turn)
    assert turn.state is state
    return turn


@pytest.mark.parametrize(("start", "to"), [(start, to) for start, tos in LEGAL.items() for to in sorted(tos)])
async def test_every_legal_move_is_made(start: TurnState, to: TurnState) -> None:
    turn = turn_in(start)
    MOVE[to](turn)
    assert turn.state is to


@pytest.mark.parametrize(("start", "to"), [(start, to) for start in S for to in S
                                           if to not in LEGAL[start] and to is not S.CLAIMED])
async def test_every_other_move_is_refused_and_the_state_kept(start: TurnState, to: TurnState) -> None:
    turn = turn_in(start)
    with pytest.raises(IllegalMove) as refused:
        MOVE[to](turn)
    assert (refused.value.state, refused.value.to) == (start, to)
    assert turn.state is start


@pytest.mark.parametrize("start", [state for state in S if state is not S.OFFERED])
async def test_a_claim_heard_when_not_offered_changes_nothing(start: TurnState) -> None:
    """The word of a claim may be late (about an offer withdrawn since) or come during a withdrawal:
    it is no move, and the withdrawal's answer settles the turn."""
    turn = turn_in(start)
    heard = turn.word.is_set()
    assert turn.claim() is False
    assert turn.state is start and turn.word.is_set() is heard


async def test_a_claim_and_a_cancel_wake_an_offered_turn_by_its_word() -> None:
    claimed, cancelled = turn_in(S.OFFERED), turn_in(S.OFFERED)
    assert not claimed.word.is_set()
    assert claimed.claim() is True
    cancelled.withdraw()
    assert claimed.word.is_set() and cancelled.word.is_set()
    claimed.offer()  # offered again: a new word is waited for
    assert not claimed.word.is_set() and claimed.offered


class HeldWithdrawal(OneDaemonRequests):
    """Every offer is taken; the first withdrawal waits until the test answers it, later ones keep the turn."""

    def __init__(self) -> None:
        self.offers: list[str] = []
        self.asked = asyncio.Event()
        self.answer: asyncio.Future[bool] | None = None

    async def offer(self, request_id: str) -> bool:
        self.offers.append(request_id)
        return True

    async def withdraw(self, request_id: str) -> bool:
        if self.answer is not None:
            return True
        self.answer = asyncio.get_running_loop().create_future()
        self.asked.set()
        return await self.answer


async def until(check: Callable[[], bool], what: str) -> None:
    for _ in range(2000):
        if check():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(what)


@pytest.mark.parametrize(("still_ours", "first_ends"), [(False, "handed_over"), (True, "cancelled")])
async def test_a_claim_heard_during_a_withdrawal_answers_every_job_of_the_conversation(
        still_ours: bool, first_ends: str) -> None:
    pool = HeldWithdrawal()
    scheduler = Scheduler(ConcurrencyLimits(1, lambda _model: None), offers=pool)
    ended: dict[str, str] = {}
    release = asyncio.Event()

    def job(key: str, ticket: str, place: int, hold: bool = False) -> Job:
        async def run() -> None:
            if hold:
                await release.wait()
            ended[ticket] = "done"

        return Job(key=key, model="m", run=run, ticket=ticket, place=place,
                   on_cancel_queued=lambda: ended.setdefault(ticket, "cancelled"),
                   on_taken_over=lambda: ended.setdefault(ticket, "handed_over"))

    scheduler.submit(job("busy", "a", 1, hold=True))  # holds the one slot
    await until(lambda: scheduler.running == 1, "a runs")
    offered, behind = job("c", "b", 1), job("c", "c", 2)
    scheduler.submit(offered)
    scheduler.submit(behind)
    await until(lambda: pool.offers == ["b"], "b is offered while it waits for the slot")
    assert scheduler.cancel(offered)  # the cancel's word: b's offer is being withdrawn
    await asyncio.wait_for(pool.asked.wait(), 10)
    assert offered.turn.state is TurnState.WITHDRAWN
    scheduler.claimed("b")  # the claim's word arrives during the withdrawal
    assert pool.answer is not None
    pool.answer.set_result(still_ours)
    await until(lambda: "b" in ended, "b is answered")
    release.set()
    await until(lambda: "c" in ended, "the job behind b is answered")
    assert ended == {"a": "done", "b": first_ends, "c": "done"}
    assert offered.turn.state is (TurnState.ENDED if still_ours else TurnState.HANDED_OVER)
    await until(lambda: scheduler.queued == 0 and scheduler.active_conversations == 0, "the queues are empty")
