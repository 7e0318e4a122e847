"""Creating the same id twice at once (import new_id, fork new_id, completion create, agent:spawn):
exactly one creates it, the others get conversation_exists or agent_exists (a completion with
`create` continues the winner's conversation); never two writers on one index."""

from __future__ import annotations

import asyncio
import random
from typing import Any

from ksi_common.client import KsiClient
from ksi_common.records import read_index
from ksi_daemon.daemon import Daemon
from tests.conftest import complete


def export_of(answers: int) -> dict[str, Any]:
    exchanges = [{"inputs": [{"type": "user", "content": f"q{k}"}],
                  "reply": {"content": f"a{k}", "model": "echo/x"}, "model": "echo/x"} for k in range(answers)]
    return {"v": 1, "format": "ksi.conversation", "conversation": {"title": "imported"}, "exchanges": exchanges}


async def test_one_creator_wins_each_id(daemon: Daemon, client: KsiClient) -> None:
    await complete(client, prompt="parent", model="echo/x", conversation_id="parent", create=True)
    rng = random.Random(7)
    for round_number in range(6):
        target = f"race-{round_number}"
        attempts: list[tuple[str, dict[str, Any]]] = [
            ("conversation:import", {"data": export_of(2), "new_id": target}),
            ("conversation:import", {"data": export_of(3), "new_id": target}),
            ("conversation:fork", {"conversation_id": "parent", "new_id": target}),
            ("conversation:fork", {"conversation_id": "parent", "new_id": target}),
            ("agent:spawn", {"agent_id": target, "model": "echo/x"}),
            ("agent:spawn", {"agent_id": target, "model": "echo/x"}),
            ("completion:async", {"prompt": "mine", "model": "echo/x", "conversation_id": target, "create": True}),
        ]
        rng.shuffle(attempts)
        clients = [KsiClient(daemon.settings.socket) for _ in attempts]
        for each in clients:
            await each.connect()
        try:
            frames = await asyncio.gather(*(each.send_frame(event, data)
                                            for each, (event, data) in zip(clients, attempts, strict=True)))
        finally:
            for each in clients:
                await each.close()
        outcomes = [(event, frame["error"]["code"] if "error" in frame else "ok")
                    for (event, _data), frame in zip(attempts, frames, strict=True)]
        creators = [event for event, code in outcomes if code == "ok" and event != "completion:async"]
        completion_ok = ("completion:async", "ok") in outcomes
        assert len(creators) <= 1, outcomes
        assert creators or completion_ok, outcomes
        for event, code in outcomes:
            if code == "ok":
                continue
            assert code in ("conversation_exists", "agent_exists"), outcomes
        await asyncio.sleep(0)
        # drain the completion, then the index has one writer's numbering
        for request in daemon.completion.requests.live():
            await request.done.wait()
        entries = read_index(daemon.layout.index_file(target)) if daemon.layout.index_file(target).exists() else []
        numbers = [e.n for e in entries]
        assert numbers == sorted(set(numbers)), (outcomes, numbers)
        assert len({e.response_id for e in entries}) == len(entries)
