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
