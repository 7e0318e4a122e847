"""The contract of the pool's ports: an optional capability. Only the backends the table declares
shared (`Backend.shared`) run these, with two storages on one place, as two daemons would; that
every backend says what the table declares is checked in test_table."""

from __future__ import annotations

import asyncio

import pytest

from ksi_common.storage_backends import BACKENDS, Backend, backend_named
from ksi_daemon.storage.ports import DaemonInfo, Storage
from tests.storage_contract.conftest import Opener


@pytest.fixture(params=[backend.name for backend in BACKENDS if backend.shared])
def contract_backend(request: pytest.FixtureRequest) -> Backend:
    """Here, only the backends that declare a pool (the conftest's fixture of that name gives all)."""
    return backend_named(request.param)


@pytest.fixture
def shared_backend(contract_backend: Backend) -> Backend:
    return contract_backend


async def test_daemons_see_each_other_registered_and_one_leaving(shared_backend: Backend, storage: Storage,
                                                                  open_storage: Opener) -> None:
    async with open_storage() as other:
        assert storage.daemon_id != other.daemon_id
        assert await storage.daemons.beat(DaemonInfo(storage.daemon_id, "h", 1, "v"), 20.0, 2, 1, 0)
        assert await other.daemons.beat(DaemonInfo(other.daemon_id, "h", 2, "v"), 10.0, 0, 0, 0)
        assert not await storage.daemons.beat(DaemonInfo(storage.daemon_id, "h", 1, "v"), 21.0, 3, 0, 0)
        members = await other.daemons.members(stale_after=60.0, prune_after=600.0)
        assert [m.daemon_id for m in members] == [storage.daemon_id, other.daemon_id]  # earliest started first
        assert members[0].in_flight == 3 and not members[0].stale
        await other.daemons.leave(storage.daemon_id)
        assert [m.daemon_id for m in await other.daemons.members(60.0, 600.0)] == [other.daemon_id]


async def test_turns_of_one_conversation_run_one_at_a_time_in_the_order_accepted(
        shared_backend: Backend, storage: Storage, open_storage: Opener) -> None:
    async with open_storage() as other:
        assert await storage.leases.line_up("c", "q1", {"n": 1}) < await other.leases.line_up("c", "q2", {"n": 2})
        assert await other.leases.in_line("c") == 2
        order: list[str] = []

        async def turn(on: Storage, request_id: str) -> None:
            async with on.leases.hold("c", request_id) as held:
                assert held
                order.append(f"{request_id} in")
                await asyncio.sleep(0)
                order.append(f"{request_id} out")

        await asyncio.gather(turn(other, "q2"), turn(storage, "q1"))  # the later one asks first
        assert order == ["q1 in", "q1 out", "q2 in", "q2 out"]
        assert await storage.leases.in_line("c") == 0


async def test_any_daemon_finds_an_accepted_request_and_its_end(shared_backend: Backend, storage: Storage,
                                                                 open_storage: Opener) -> None:
    async with open_storage() as other:
        await storage.leases.line_up("c", "q1", {"model": "echo/x"})
        found = await other.requests.find("q1")
        assert found is not None and found.daemon_id == storage.daemon_id and found.record == {"model": "echo/x"}
        assert found.status == "queued" and await other.requests.find("q-none") is None
        asked = await other.requests.ask_cancel("q1")
        assert asked is not None and asked.request_id == "q1"
        assert await storage.requests.cancels_asked() == ["q1"]
        storage.requests.ended("q1", "cancelled", "cancelled")
        await storage.requests.flush()
        ended = await other.requests.find("q1")
        assert ended is not None and (ended.status, ended.code) == ("cancelled", "cancelled")


async def test_a_turn_let_ahead_while_it_was_not_asking_still_gets_the_lease_in_its_turn(
        shared_backend: Backend, storage: Storage, open_storage: Opener) -> None:
    """A daemon takes over two turns of a silent one while its own later turn waits: the first taken
    lets its own turn step back, the second (earlier still) lets the first step back before it ever
    asked. That word must not be held against the first when its turn comes: refused then, it looked
    taken over, was dropped, and its place at the head of the line stalled the conversation."""
    async with open_storage() as silent:
        await silent.leases.line_up("c", "a1", {"n": 1})
        await silent.leases.line_up("c", "a2", {"n": 2})
        await storage.leases.line_up("c", "b1", {"n": 3})
        waiting_b1 = asyncio.ensure_future(held_once(storage, "b1"))
        await asyncio.sleep(0.2)  # b1 asks, and waits: the silent daemon's a1 is at the head
        assert not waiting_b1.done()
        await storage.leases.line_up("c", "a2", {"n": 2})  # taken over, with its place
        storage.leases.let_ahead("c", "b1")
        await storage.leases.line_up("c", "a1", {"n": 1})  # earlier still, before a2 ever asked
        storage.leases.let_ahead("c", "a2")
        assert await asyncio.wait_for(waiting_b1, 10) is False  # b1 stepped back, keeping its place
        # each in turn; refused, a turn would have stood at the head for ever (b1 waiting behind it)
        order = [request_id for request_id in ("a1", "a2", "b1")
                 if await asyncio.wait_for(held_once(storage, request_id), 10)]
        assert order == ["a1", "a2", "b1"]
        assert await storage.leases.in_line("c") == 0


async def held_once(storage: Storage, request_id: str) -> bool:
    async with storage.leases.hold("c", request_id) as held:
        return held


async def test_a_turn_let_ahead_after_its_lease_was_granted_keeps_its_place(
        shared_backend: Backend, storage: Storage) -> None:
    """Granted the lease, a turn waits for a call slot; a turn taken over with an earlier place joins
    the queue ahead of it. It gives the lease back without running and must keep its ticket: let go
    with it, its next ask found it no longer this daemon's, as if taken over, and it never ran."""
    await storage.leases.line_up("c", "b1", {"n": 1})
    async with storage.leases.hold("c", "b1") as held:
        assert held
        storage.leases.let_ahead("c", "b1")  # not run: the earlier turn goes first
    assert await storage.leases.in_line("c") == 1
    assert await asyncio.wait_for(held_once(storage, "b1"), 10)
    assert await storage.leases.in_line("c") == 0
