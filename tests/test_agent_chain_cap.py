"""Events agents emit are capped per chain of events, not only per reply and per depth."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from ksi_daemon.context import EventContext
from tests.conftest import connected
from tests.stub_openai import StubOpenAI
from tests.test_agents_events import FEEDBACK_HEADER, agents_daemon, event, last_user, settle


async def test_a_fan_out_stops_at_the_chain_limit(short_tmp: Path) -> None:
    def answer(messages: list[dict[str, Any]]) -> str:
        # every reply, feedback included, messages the other agent four times
        me = "a" if messages[0]["content"].endswith("(a)") else "b"
        other = "b" if me == "a" else "a"
        return " ".join(event("agent:send_message", agent_id=other, message=f"ping {n} from {me}")
                        for n in range(4))

    async with StubOpenAI(answer=answer) as stub, \
            agents_daemon(short_tmp, stub, max_event_depth=3, max_events_per_chain=10) as daemon, \
            connected(daemon) as client:
        for name in ("a", "b"):
            await client.request("agent:spawn", {"agent_id": name, "profile": "pinger",
                                                 "system": f"You are a pinger ({name})"})
        emitted: list[EventContext] = []
        daemon.router.listen("agent:send_message",
                             lambda _n, _d, c: emitted.append(c) if c.agent_id else None)
        await client.request("agent:send_message", {"agent_id": "a", "message": "start", "wait": True})
        await settle(daemon)
        await asyncio.sleep(0.3)
        await settle(daemon)
        # without the chain limit this chain emits 4 + 5 * 4 + 25 * 4 = 124 messages
        assert len(emitted) == 10
        assert len({c.chain_id for c in emitted}) == 1
        told = [last_user(r) for r in stub.requests if FEEDBACK_HEADER in last_user(r)]
        assert any("reached its limit of 10" in text for text in told)
        # a new chain has a budget of its own
        before = len(emitted)
        await client.request("agent:send_message", {"agent_id": "b", "message": "again", "wait": True})
        await settle(daemon)
        await asyncio.sleep(0.3)
        await settle(daemon)
        assert len(emitted) - before == 10
