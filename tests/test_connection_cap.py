"""A connection past the cap is told `too_many_connections` and closed; the daemon keeps serving."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson

from ksi_common.client import KsiClient
from tests.conftest import running_daemon


async def test_connections_past_the_cap_are_refused_with_a_reply(short_tmp: Path) -> None:
    async with running_daemon(short_tmp, max_connections=3) as daemon:
        sock = str(daemon.settings.socket)
        clients = [KsiClient(daemon.settings.socket) for _ in range(3)]
        for client in clients:
            await client.connect()
            assert (await client.request("system:health"))["status"] == "healthy"
        reader, writer = await asyncio.open_unix_connection(sock)
        reply = orjson.loads(await asyncio.wait_for(reader.readline(), 10))
        assert reply["error"]["code"] == "too_many_connections"
        assert reply["error"]["details"]["limit"] == 3
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the daemon
        writer.close()
        # the ones inside are unaffected; when one leaves, a newcomer gets in
        assert (await clients[0].request("system:health"))["status"] == "healthy"
        await clients[2].close()
        for _ in range(200):
            if len(daemon.server.connections) < 3:
                break
            await asyncio.sleep(0.01)
        async with KsiClient(daemon.settings.socket) as late:
            assert (await late.request("system:health"))["connections"] == 3
        for client in clients[:2]:
            await client.close()


async def test_the_cap_stays_below_the_descriptor_limit(short_tmp: Path) -> None:
    import resource

    async with running_daemon(short_tmp, max_connections=10**9) as daemon:
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        assert daemon.connection_budget.cap + daemon.connection_budget.backlog < soft
