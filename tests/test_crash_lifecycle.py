"""kill -9 in the middle of agent resets, forks and imports: after a restart every agent still
lists its previous conversations, every import is there whole or not at all, every fork has its
metadata, and the daemon serves on."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import orjson

from ksi_common import doctor
from ksi_common.client import KsiClient
from ksi_common.errors import KsiError
from ksi_common.layout import VarLayout
from ksi_common.records import read_index
from tests.test_crash import DaemonProcess, daemon_env

EXPORT_EXCHANGES = 6


def export_document() -> dict[str, Any]:
    exchanges = [{"inputs": [{"type": "user", "content": f"question {k}"}],
                  "reply": {"content": f"answer {k}", "model": "echo/x"}, "model": "echo/x"}
                 for k in range(EXPORT_EXCHANGES)]
    return {"v": 1, "format": "ksi.conversation", "conversation": {"title": "moved in"}, "exchanges": exchanges}


async def churn(daemon: DaemonProcess, rng: random.Random, number: int) -> None:
    """Resets, forks and imports as fast as they go, until the daemon is killed under them."""
    document = export_document()

    async def agent_loop(agent_id: str) -> None:
        async with KsiClient(daemon.socket) as client:
            try:
                await client.request("agent:spawn", {"agent_id": agent_id, "model": "echo/x"})
            except KsiError as error:
                if error.code != "agent_exists":
                    raise
            while True:
                await client.request("agent:send_message", {"agent_id": agent_id, "message": "hi", "wait": 30})
                await client.request("agent:reset", {"agent_id": agent_id})

    async def fork_loop() -> None:
        async with KsiClient(daemon.socket) as client:
            k = 0
            while True:
                k += 1
                await client.request("conversation:fork", {"conversation_id": "src", "new_id": f"f{number}-{k}"})

    async def import_loop() -> None:
        async with KsiClient(daemon.socket) as client:
            k = 0
            while True:
                k += 1
                await client.request("conversation:import", {"data": document, "new_id": f"i{number}-{k}"})

    tasks = [asyncio.create_task(loop) for loop in
             (agent_loop("ag1"), agent_loop("ag2"), fork_loop(), import_loop())]
    await asyncio.sleep(rng.uniform(0.3, 1.2))
    daemon.kill()
    await asyncio.gather(*tasks, return_exceptions=True)


def check_var(var: Path, restarted: bool = True) -> None:
    layout = VarLayout(var)
    metas = {p.stem: orjson.loads(p.read_bytes()) for p in layout.conversation_meta_dir.glob("*.json")}
    indexes = {p.stem for p in layout.conversations_dir.glob("*.jsonl")}
    # an index never stands without its metadata (a half-moved or half-imported conversation)
    assert indexes <= set(metas), sorted(indexes - set(metas))
    for agent_file in layout.agents_dir.glob("*.json"):
        record = orjson.loads(agent_file.read_bytes())
        moved_away = sorted(cid for cid, meta in metas.items()
                            if (meta.get("extra") or {}).get("reset_from") == record["conversation_id"])
        listed = sorted(record["previous_conversations"])
        # killed between naming and moving, one may be listed not yet moved; a restart settles it
        if restarted:
            assert listed == moved_away, (record["agent_id"], listed, moved_away)
        else:
            assert set(moved_away) <= set(listed) and len(listed) - len(moved_away) <= 1, (listed, moved_away)
    for conversation_id, meta in metas.items():
        if (meta.get("extra") or {}).get("imported_from") is not None or meta.get("title") == "moved in":
            pending = layout.conversations_dir / f".{conversation_id}.jsonl.importing"
            if not restarted and pending.exists():
                continue  # committed (its metadata is written): the restart puts its index in place
            entries = read_index(layout.index_file(conversation_id))
            assert [e.n for e in entries] == list(range(1, EXPORT_EXCHANGES + 1)), conversation_id
        if meta.get("parent_id"):
            assert meta["parent_id"] in metas or meta["parent_id"] in indexes
    report = doctor.check(var)
    # killed inside a reset's move (metadata written under the new name, the index not yet moved):
    # a stray copy the restart removes
    strays = set() if restarted else {cid for cid, meta in metas.items() if (meta.get("extra") or {}).get("reset_from")}
    unexpected = [p for p in report.problems if p.kind not in ("torn_tail", "stale_pid", "stale_socket")
                  and not (p.kind == "metadata_without_index" and p.extra.get("conversation_id") in strays)]
    assert not unexpected, unexpected


async def test_kills_during_resets_forks_and_imports(short_tmp: Path) -> None:
    rng = random.Random()
    daemon = DaemonProcess(short_tmp, daemon_env("http://127.0.0.1:9/v1", KSI_DEFAULT_MODEL="echo/x"))
    await daemon.start()
    async with KsiClient(daemon.socket) as client:
        ack = await client.request("completion:async", {"prompt": "root", "model": "echo/x",
                                                        "conversation_id": "src", "create": True})
        await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 60})
    for number in range(1, 5):
        await churn(daemon, rng, number)
        check_var(daemon.var, restarted=False)
        await daemon.start()
        check_var(daemon.var)  # what the restarted daemon settled
    async with KsiClient(daemon.socket) as client:
        for agent_id in ("ag1", "ag2"):
            info = await client.request("agent:info", {"agent_id": agent_id})
            for previous in info["previous_conversations"]:
                await client.request("conversation:show", {"conversation_id": previous})
            reply = await client.request("agent:send_message", {"agent_id": agent_id, "message": "still here?",
                                                                "wait": 30})
            assert "still here?" in reply["content"]
    await daemon.stop()
    check_var(daemon.var)
