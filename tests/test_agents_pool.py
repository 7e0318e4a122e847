"""`agent:list` and `agent:info` on every daemon sharing PostgreSQL count an agent's exchanges from
the database, whichever daemon ran them (a second daemon used to show 0 for an agent the first
one messaged, or its own stale count once it had the conversation in memory)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.conftest import connected, running_daemon


async def exchanges_seen(client: Any, agent_id: str) -> tuple[int, int]:
    listed = {a["agent_id"]: a for a in (await client.request("agent:list", {}))["agents"]}
    info = await client.request("agent:info", {"agent_id": agent_id})
    return int(listed[agent_id]["exchanges"]), int(info["exchanges"])


async def test_every_daemon_of_the_pool_counts_an_agents_exchanges(short_tmp: Path, pg_url: str) -> None:
    shared: dict[str, Any] = {"storage": "postgres", "database_url": pg_url, "litellm_preload": False}
    async with running_daemon(short_tmp / "a", **shared) as a, running_daemon(short_tmp / "b", **shared) as b, \
            connected(a) as first, connected(b) as second:
        agent = (await first.request("agent:spawn", {"agent_id": "helper", "model": "echo/demo"}))["agent_id"]
        await first.request("agent:send_message", {"agent_id": agent, "message": "one", "wait": 30})
        assert await exchanges_seen(first, agent) == (1, 1)
        assert await exchanges_seen(second, agent) == (1, 1)
        await second.request("agent:send_message", {"agent_id": agent, "message": "two", "wait": 30})
        await first.request("agent:send_message", {"agent_id": agent, "message": "three", "wait": 30})
        # the second daemon holds the conversation in memory since its turn: still counted anew
        assert await exchanges_seen(second, agent) == (3, 3)
        assert await exchanges_seen(first, agent) == (3, 3)
        async with running_daemon(short_tmp / "c", **shared) as c, connected(c) as third:  # started after them
            assert await exchanges_seen(third, agent) == (3, 3)
