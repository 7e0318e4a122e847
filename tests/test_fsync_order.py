"""With KSI_FSYNC=always, what is synced and in which order: an exchange (with the metadata of a
conversation made for it) by one synced record of the exchange log, its files at the next
checkpoint; a conversation made by conversation:fork before the fork's reply."""

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


async def test_an_exchange_is_durable_by_one_synced_log_record(short_tmp: Path, stub: Any, synced: list[str]) -> None:
    async with running_daemon(short_tmp, **stub_settings(stub, fsync="always")) as daemon, \
            connected(daemon) as client:
        var = daemon.settings.layout.root
        synced.clear()
        result = await complete(client, prompt="hello", conversation_id="c", create=True)
        # a new conversation: its log generation (found again after a crash), then the record
        assert relative(synced, var) == ["state/exchange-log", "state/exchange-log/0.jsonl"]
        [record] = daemon.storage.conversations.log.records()
        assert record["meta"]["conversation_id"] == "c"  # the metadata travels with the first exchange
        assert record["entry"]["response_id"] == result["response_id"] and record["entry"]["n"] == 1
        assert [line["type"] for line in record["response"]] == ["user", "assistant"]

        synced.clear()
        await complete(client, prompt="again", conversation_id="c")
        assert relative(synced, var) == ["state/exchange-log/0.jsonl"]  # one fsync per exchange
        assert "meta" not in daemon.storage.conversations.log.records()[-1]

        synced.clear()
        await daemon.storage.conversations.checkpoint()  # the files synced in bulk, the log dropped
        assert daemon.storage.conversations.log.records() == []
        assert not list((var / "state" / "exchange-log").iterdir())

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
