"""With KSI_FSYNC=always, what is synced and in which order: a conversation made for a request is
durable before its first exchange's index line (synced with that exchange, not at the ack); one
made by conversation:fork is durable before the fork's reply."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import complete, connected, running_daemon, stub_settings


@pytest.fixture
def synced(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The paths os.fsync was called on, in order (the daemon runs in this process)."""
    paths: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        paths.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    yield paths


def relative(paths: list[str], var: Path) -> list[str]:
    root = str(var.resolve())
    return [p[len(root) + 1:] for p in paths if p.startswith(root + "/")]


async def test_a_conversation_made_for_a_request_is_durable_before_its_first_exchange(
        short_tmp: Path, stub: Any, synced: list[str]) -> None:
    async with running_daemon(short_tmp, **stub_settings(stub, fsync="always")) as daemon, \
            connected(daemon) as client:
        var = daemon.settings.layout.root
        synced.clear()
        result = await complete(client, prompt="hello", conversation_id="c", create=True)
        order = relative(synced, var)
        meta, index = "state/conversations/c.json", "logs/conversations/c.jsonl"
        response = f"logs/responses/{result['response_id']}.jsonl"
        assert meta in order and "state/conversations" in order
        assert order.index(meta) < order.index("state/conversations") < order.index(index)
        assert order.index(response) < order.index("logs/responses") < order.index(index)

        synced.clear()
        await complete(client, prompt="again", conversation_id="c")
        assert meta not in relative(synced, var)  # synced once, with the first exchange

        synced.clear()
        await client.request("conversation:fork", {"conversation_id": "c", "new_id": "f"})
        forked = relative(synced, var)
        # durable before the fork's reply: the file (written aside, then linked) and its directory
        assert forked[-1] == "state/conversations"
        assert any(p.startswith("state/conversations/.f.json.") for p in forked)


async def test_a_replaced_record_is_durable_with_its_rename(short_tmp: Path, stub: Any, synced: list[str]) -> None:
    """Agent records are written aside and renamed over the old one: the rename is synced too."""
    async with running_daemon(short_tmp, **stub_settings(stub, fsync="always")) as daemon, \
            connected(daemon) as client:
        var = daemon.settings.layout.root
        await client.request("agent:spawn", {"agent_id": "scribe", "system": "Be brief."})
        synced.clear()
        await client.request("agent:terminate", {"agent_id": "scribe"})
        order = relative(synced, var)
        written = [i for i, p in enumerate(order) if p == "state/agents/.scribe.json.tmp"]
        assert written, order
        assert "state/agents" in order[written[-1] + 1:]  # the directory after the file's content
