"""Moving data between storages through the ports: everything carried over with its counts
verified, idempotent, finished by a second run after an interruption, and the conversations'
export identical on the other side (where they also continue)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ksi_common.errors import KsiError
from ksi_common.summaries import Summary
from ksi_daemon.storage.jsonl.storage import JsonlStorage
from ksi_daemon.storage.migrate import count, migrate
from ksi_daemon.storage.ports import Storage
from tests.conftest import complete, connected, make_settings, running_daemon
from tests.stub_openai import Reply

VERDICT = json.dumps({"synthesis": "both", "confidence": 0.95, "dissent": "", "refinement_areas": [],
                      "needs_iteration": False, "ranking": [1]})


async def fill(root: Path, stub: Any) -> dict[str, str]:
    """A var dir with conversations, a fork, an agent, a saved consortium and its run, a failed
    request: what a daemon leaves behind. Returns each conversation's jsonl export."""
    models = {"openai/*": {"api_base": stub.api_base}}
    async with running_daemon(root, models=models, retry_attempts=1) as daemon, connected(daemon) as client:
        for n in range(3):
            await complete(client, prompt=f"first {n}", model="openai/stub-a", conversation_id="talk", create=True)
        fork = await client.request("conversation:fork", {"conversation_id": "talk", "at": 2, "new_id": "branch"})
        await complete(client, prompt="in the branch", conversation_id=fork["conversation_id"])
        await client.request("agent:spawn", {"agent_id": "ada", "system": "Be brief.", "model": "openai/stub-a"})
        await client.request("agent:send_message", {"agent_id": "ada", "message": "hello", "wait": 30})
        await client.request("consortium:save", {"name": "pair", "members": ["openai/stub-m:2"],
                                                 "arbiter": "openai/stub-j"})
        stub.enqueue("member one", "member two", VERDICT)
        await complete(client, prompt="decide", model="consortium/pair", conversation_id="vote", create=True)
        stub.enqueue(Reply(status=400, body='{"error": {"message": "bad request"}}'))
        ack = await client.request("completion:async", {"prompt": "fails", "conversation_id": "talk",
                                                        "model": "openai/stub-a"})
        with pytest.raises(KsiError):  # logged in responses/, never indexed
            await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 30})
        # a compaction summary of the first two exchanges, as the compactor appends one
        await daemon.storage.summaries.append(Summary(conversation_id="talk", upto=2, text="They said hello twice.",
                                                      tokens=12, ts="2026-01-01T00:00:00Z"))
        ids = await daemon.store.conversation_ids()
        return {cid: (await client.request("conversation:export", {"conversation_id": cid, "format": "jsonl"}))
                ["content"] for cid in ids}


def storage_at(root: Path) -> Storage:
    return JsonlStorage(make_settings(root, fsync="never"))


async def test_migration_carries_everything_and_is_idempotent(short_tmp: Path, stub: Any) -> None:
    exports = await fill(short_tmp / "a", stub)
    source, destination = storage_at(short_tmp / "a"), storage_at(short_tmp / "b")
    await source.open()
    await destination.open()
    tally = await migrate(source, destination)
    assert tally.verified, tally.to_dict()
    held = await count(source)
    assert held["conversations"] == 4 and held["exchanges"] >= 6 and held["agents"] == 1
    assert held["consortia"] == 1 and held["trace_lines"] > 0 and held["summaries"] == 1
    assert held["responses"] > held["exchanges"]  # consortium calls and the failed request too
    assert tally.destination == held
    again = await migrate(source, destination)
    assert again.copied == {} and again.verified
    await source.close()
    await destination.close()

    # the copy is a var dir like any other: same exports, and its conversations continue
    models = {"openai/*": {"api_base": stub.api_base}}
    async with running_daemon(short_tmp / "b", models=models) as daemon, connected(daemon) as client:
        for conversation_id, content in exports.items():
            copied = await client.request("conversation:export", {"conversation_id": conversation_id,
                                                                  "format": "jsonl"})
            assert copied["content"] == content
        result = await complete(client, prompt="after the move", conversation_id="talk")
    assert result["exchange"] == 4
    sent = [m["content"] for m in stub.messages() if m["role"] == "user"]
    assert sent == ["first 0", "first 1", "first 2", "after the move"]


class Interrupted(Exception):
    pass


async def test_an_interrupted_migration_is_finished_by_running_it_again(short_tmp: Path, stub: Any) -> None:
    exports = await fill(short_tmp / "a", stub)
    source, destination = storage_at(short_tmp / "a"), storage_at(short_tmp / "b")
    await source.open()
    await destination.open()
    append = destination.conversations.append_exchange
    calls = 0

    async def failing_append(*args: Any, **kwargs: Any) -> None:  # the copy dies after 3 exchanges
        nonlocal calls
        calls += 1
        if calls > 3:
            raise Interrupted
        await append(*args, **kwargs)

    destination.conversations.append_exchange = failing_append  # type: ignore[method-assign]
    with pytest.raises(Interrupted):
        await migrate(source, destination)
    partial = await count(destination)
    assert 0 < partial["exchanges"] < (await count(source))["exchanges"]
    destination.conversations.append_exchange = append  # type: ignore[method-assign]
    finished = await migrate(source, destination)
    assert finished.verified and finished.destination == finished.source
    assert 0 < finished.copied["exchanges"] < finished.source["exchanges"]  # only what was missing
    await source.close()
    await destination.close()
    async with running_daemon(short_tmp / "b") as daemon, connected(daemon) as client:
        for conversation_id, content in exports.items():
            copied = await client.request("conversation:export", {"conversation_id": conversation_id,
                                                                  "format": "jsonl"})
            assert copied["content"] == content


def test_migrate_needs_a_database_url_and_a_stopped_daemon(short_tmp: Path) -> None:
    import filelock

    from tests.test_crash import REPO, daemon_env

    env = daemon_env("http://127.0.0.1:9/v1")
    var = short_tmp / "var"
    command = [sys.executable, "-m", "ksi_cli", "storage", "migrate", "--to", "postgres", "--var-dir", str(var)]
    missing = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "database URL" in missing.stderr
    var.joinpath("run").mkdir(parents=True)
    with filelock.FileLock(str(var / "run" / "daemon.lock")):  # as a running daemon holds it
        running = subprocess.run([*command, "--database-url", "postgresql://ksi:pw-secret@127.0.0.1:9/ksi"],
                                 cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert running.returncode == 1 and "stop it first" in running.stderr
    assert "pw-secret" not in running.stdout + running.stderr
