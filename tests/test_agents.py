"""Agents over the socket: spawn, talk, remember across restarts, reset, terminate, bad input."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import orjson
import pytest

from ksi_common.client import KsiClient
from ksi_common.errors import KsiError
from ksi_daemon.daemon import Daemon
from ksi_daemon.services.agents.profiles import ProfileLibrary, shipped_profiles_dir
from tests.conftest import complete, connected, running_daemon, stub_settings
from tests.stored import names, stored_index, stored_meta, stored_snapshot
from tests.stub_openai import Reply

pytestmark = pytest.mark.backends

TESTER_SYSTEM = "You are Tester. Remember everything the user tells you."


def write_profiles(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tester.md").write_text(
        "---\ndescription: remembers things\ntemperature: 0.3\n---\n\n" + TESTER_SYSTEM + "\n"
    )
    (directory / "plain.yaml").write_text("description: a plain one\nmodel: echo/plain\nsystem: Be plain.\n")
    (directory / "broken.yaml").write_text("name: broken\nsytem: typo in a key\n")
    return directory


async def error_of(client: KsiClient, event: str, data: dict[str, Any]) -> KsiError:
    with pytest.raises(KsiError) as caught:
        await client.request(event, data)
    return caught.value


async def send(client: KsiClient, agent_id: str, message: str, wait: Any = True) -> dict[str, Any]:
    return await client.request("agent:send_message", {"agent_id": agent_id, "message": message, "wait": wait})


async def until(condition: Any, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


# -- continuity -----------------------------------------------------------------------------


async def test_spawn_two_messages_restart_third_message_sees_everything(short_tmp: Path, stub: Any,
                                                                       backend: dict[str, Any]) -> None:
    profiles = write_profiles(short_tmp / "profiles")
    settings = stub_settings(stub, profiles_dir=profiles, **backend)
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        spawned = await client.request("agent:spawn", {"agent_id": "alice", "profile": "tester"})
        assert spawned["conversation_id"] == "alice"
        assert spawned["model"] == "openai/stub-model"  # the profile names none: the daemon's default
        first = await send(client, "alice", "My name is Alice")
        second = await send(client, "alice", "I am a dentist")
        assert first["conversation_id"] == second["conversation_id"] == "alice"
        assert first["agent_id"] == "alice"
    assert "state/agents/alice.json" in await stored_snapshot(daemon.settings)
    assert stub.requests[-1]["temperature"] == 0.3  # the profile's temperature reaches the provider

    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        info = await client.request("agent:info", {"agent_id": "alice"})
        assert (info["status"], info["profile"], info["exchanges"]) == ("active", "tester", 2)
        third = await send(client, "alice", "What do I do?")
    sent = stub.messages(-1)
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert sent[0]["content"] == TESTER_SYSTEM
    assert sum(1 for m in sent if m["content"] == TESTER_SYSTEM) == 1
    assert [m["content"] for m in sent[1:]] == [
        "My name is Alice", first["content"], "I am a dentist", second["content"], "What do I do?",
    ]
    assert third["content"] == "stub answer to: What do I do?"
    assert len(await stored_index(daemon, "alice")) == 3


async def test_spawn_with_first_prompt_and_generated_id(daemon: Daemon, client: KsiClient) -> None:
    spawned = await client.request("agent:spawn", {"profile": "assistant", "prompt": "hello there",
                                                   "metadata": {"team": "blue"}})
    assert re.fullmatch(r"agent_[0-9a-f]{8}", spawned["agent_id"])
    assert spawned["conversation_id"] == spawned["agent_id"]
    result = await client.request("completion:wait", {"request_id": spawned["request_id"], "timeout": 30})
    assert result["content"].startswith("You said: hello there")
    assert "(system: 1)" in result["content"]  # the profile's system prompt was sent
    info = await client.request("agent:info", {"agent_id": spawned["agent_id"]})
    assert info["metadata"] == {"team": "blue"}
    assert info["model"] == daemon.settings.default_model
    assert info["exchanges"] == 1
    assert info["tokens"]["in"] > 0 and info["tokens"]["out"] > 0
    assert info["last_activity"] >= info["created"]


async def test_spawn_without_profile_uses_given_system_and_model(client: KsiClient) -> None:
    await client.request("agent:spawn", {"agent_id": "bare", "system": "Be brief.", "model": "echo/other"})
    result = await send(client, "bare", "hi")
    assert result["model"] == "echo/other"
    info = await client.request("agent:info", {"agent_id": "bare"})
    assert (info["system"], info["profile"], info["allowed_events"]) == ("Be brief.", None, [])


async def test_send_message_wait_forms(client: KsiClient) -> None:
    await client.request("agent:spawn", {"agent_id": "w1", "profile": "assistant"})
    ack = await send(client, "w1", "no wait", wait=False)
    assert ack["status"] == "queued" and ack["agent_id"] == "w1" and "content" not in ack
    waited = await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 30})
    assert waited["content"].startswith("You said: no wait")
    numeric = await send(client, "w1", "seconds", wait=20)
    assert numeric["content"].startswith("You said: seconds")
    assert "Earlier user inputs: no wait" in numeric["content"]


# -- reset ----------------------------------------------------------------------------------


async def test_reset_starts_fresh_and_keeps_the_old_conversation(short_tmp: Path, stub: Any,
                                                                 backend: dict[str, Any]) -> None:
    profiles = write_profiles(short_tmp / "profiles")
    async with running_daemon(short_tmp, **stub_settings(stub, profiles_dir=profiles, **backend)) as daemon, \
            connected(daemon) as client:
        await client.request("agent:spawn", {"agent_id": "bob", "profile": "tester"})
        first = await send(client, "bob", "remember 42")
        await send(client, "bob", "and 43")
        before = (await stored_snapshot(daemon.settings))["logs/conversations/bob.jsonl"]

        reset = await client.request("agent:reset", {"agent_id": "bob"})
        assert reset == {"agent_id": "bob", "conversation_id": "bob", "previous_conversation_id": "bob-1",
                         "cancelled": []}
        await send(client, "bob", "what do you remember?")
        sent = stub.messages(-1)
        assert [m["role"] for m in sent] == ["system", "user"]
        assert sent[0]["content"] == TESTER_SYSTEM

        # the old conversation: the same index under the new id, metadata moved and renamed
        assert (await stored_snapshot(daemon.settings))["logs/conversations/bob-1.jsonl"] == before
        meta = await stored_meta(daemon, "bob-1") or {}
        assert meta["conversation_id"] == "bob-1" and meta["exchanges"] == 2
        assert meta["extra"]["reset_from"] == "bob"
        assert len(await stored_index(daemon, "bob")) == 1
        assert {"bob", "bob-1"} <= set(await daemon.store.conversation_ids())
        listed = await client.request("conversation:list", {"agent_id": "bob"})
        assert {c["conversation_id"] for c in listed["conversations"]} == {"bob", "bob-1"}
        shown = await client.request("conversation:show", {"conversation_id": "bob-1"})
        assert [x["inputs"][0]["content"] for x in shown["exchanges"]] == ["remember 42", "and 43"]
        assert shown["exchanges"][0]["reply"]["content"] == first["content"]

        # readable and continuable through its new id
        more = await client.request("completion:async", {"conversation_id": "bob-1", "prompt": "still there?"})
        await client.request("completion:wait", {"request_id": more["request_id"], "timeout": 30})
        old = stub.messages(-1)
        assert [m["content"] for m in old[1:4]] == ["remember 42", first["content"], "and 43"]

        info = await client.request("agent:info", {"agent_id": "bob"})
        assert info["previous_conversations"] == ["bob-1"] and info["exchanges"] == 1
        second_reset = await client.request("agent:reset", {"agent_id": "bob"})
        assert second_reset["previous_conversation_id"] == "bob-2"


async def test_deleting_after_a_reset_keeps_the_other_conversations_files(short_tmp: Path,
                                                                          backend: dict[str, Any]) -> None:
    async with running_daemon(short_tmp, **backend) as daemon, connected(daemon) as client:
        await client.request("agent:spawn", {"agent_id": "eve", "model": "echo/x"})
        await send(client, "eve", "old message")
        await client.request("agent:reset", {"agent_id": "eve"})
        await send(client, "eve", "new message")
        old_files = {f"{e['response_id']}.jsonl" for e in await stored_index(daemon, "eve-1")}
        new_files = {f"{e['response_id']}.jsonl" for e in await stored_index(daemon, "eve")}

        await client.request("conversation:delete", {"conversation_id": "eve"})
        responses = names(await stored_snapshot(daemon.settings), "logs/responses/")
        assert old_files <= responses and not new_files & responses
        shown = await client.request("conversation:show", {"conversation_id": "eve-1"})
        assert shown["exchanges"][0]["reply"]["content"].startswith("You said: old message")

        await client.request("conversation:delete", {"conversation_id": "eve-1"})
        assert not old_files & names(await stored_snapshot(daemon.settings), "logs/responses/")


async def test_reset_after_restart_and_of_an_unused_agent(short_tmp: Path, backend: dict[str, Any]) -> None:
    async with running_daemon(short_tmp, **backend) as daemon, connected(daemon) as client:
        await client.request("agent:spawn", {"agent_id": "carol", "profile": "assistant"})
        await client.request("agent:spawn", {"agent_id": "idle", "profile": "assistant"})
        await send(client, "carol", "one")
        unused = await client.request("agent:reset", {"agent_id": "idle"})
        assert unused["previous_conversation_id"] is None  # nothing to keep
    async with running_daemon(short_tmp, **backend) as daemon, connected(daemon) as client:
        assert daemon.cache.cached("carol") is None
        reset = await client.request("agent:reset", {"agent_id": "carol"})
        assert reset["previous_conversation_id"] == "carol-1"
        result = await send(client, "carol", "two")
        assert "Earlier user inputs: none" in result["content"]
    async with running_daemon(short_tmp, **backend) as daemon, connected(daemon) as client:
        info = await client.request("agent:info", {"agent_id": "carol"})
        assert info["previous_conversations"] == ["carol-1"] and info["exchanges"] == 1


async def test_forks_follow_a_reset_conversation(client: KsiClient) -> None:
    await client.request("agent:spawn", {"agent_id": "dora", "profile": "assistant"})
    await send(client, "dora", "first")
    await send(client, "dora", "second")
    await client.request("conversation:fork", {"conversation_id": "dora", "at": 1, "new_id": "dora-fork"})
    await client.request("agent:reset", {"agent_id": "dora"})
    await send(client, "dora", "fresh start")  # the fresh conversation must not leak into the fork
    ack = await client.request("completion:async", {"conversation_id": "dora-fork", "prompt": "in the fork"})
    forked = await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 30})
    assert "Earlier user inputs: first\n" in forked["content"] + "\n"
    shown = await client.request("conversation:show", {"conversation_id": "dora-fork"})
    assert shown["conversation"]["parent_id"] == "dora-1"


async def test_reset_cancels_queued_requests(stub_daemon: Daemon, stub: Any) -> None:
    async with connected(stub_daemon) as client:
        await client.request("agent:spawn", {"agent_id": "busy"})
        stub.enqueue(Reply(text="slow", delay=1.0))
        acks = [await send(client, "busy", f"m{i}", wait=False) for i in range(3)]
        await until(lambda: stub.in_flight == 1)  # the first one is running, the others queued
        reset = await client.request("agent:reset", {"agent_id": "busy"})
        assert set(reset["cancelled"]) == {a["request_id"] for a in acks}
        for ack in acks:
            error = await error_of(client, "completion:wait", {"request_id": ack["request_id"], "timeout": 5})
            assert error.code == "cancelled"
        assert reset["previous_conversation_id"] is None  # no exchange had completed
        result = await send(client, "busy", "fresh")
        assert [m["role"] for m in stub.messages(-1)] == ["user"]
        assert result["content"] == "stub answer to: fresh"


# -- terminate ------------------------------------------------------------------------------


async def test_terminate_cancels_queued_keeps_logs_and_refuses_messages(stub_daemon: Daemon, stub: Any) -> None:
    async with connected(stub_daemon) as client:
        await client.request("agent:spawn", {"agent_id": "t1"})
        await send(client, "t1", "kept")
        stub.enqueue(Reply(text="slow", delay=1.0))
        acks = [await send(client, "t1", f"q{i}", wait=False) for i in range(3)]
        await until(lambda: stub.in_flight == 1)
        done = await client.request("agent:terminate", {"agent_id": "t1"})
        assert done["terminated"] == ["t1"] and done["status"] == "terminated"
        assert set(done["cancelled"]) == {a["request_id"] for a in acks}
        for ack in acks:
            status = await client.request("completion:status", {"request_id": ack["request_id"]})
            assert status["status"] == "cancelled"

        error = await error_of(client, "agent:send_message", {"agent_id": "t1", "message": "hello?"})
        assert error.code == "agent_terminated"
        error = await error_of(client, "completion:async", {"agent_id": "t1", "prompt": "direct"})
        assert error.code == "agent_terminated"
        error = await error_of(client, "agent:reset", {"agent_id": "t1"})
        assert error.code == "agent_terminated"
        info = await client.request("agent:info", {"agent_id": "t1"})
        assert info["status"] == "terminated" and info["terminated_at"] and info["queued_requests"] == 0
        again = await client.request("agent:terminate", {"agent_id": "t1"})
        assert again["terminated"] == []  # terminating twice is harmless
        error = await error_of(client, "agent:spawn", {"agent_id": "t1"})
        assert error.code == "agent_exists"
    assert len(await stored_index(stub_daemon, "t1")) == 1  # the log is kept
    record = orjson.loads((await stored_snapshot(stub_daemon.settings))["state/agents/t1.json"])
    assert record["status"] == "terminated"


async def test_terminate_all(short_tmp: Path, backend: dict[str, Any]) -> None:
    async with running_daemon(short_tmp, **backend) as daemon, connected(daemon) as client:
        for name in ("a1", "a2", "a3"):
            await client.request("agent:spawn", {"agent_id": name, "profile": "assistant"})
        await client.request("agent:terminate", {"agent_id": "a1"})
        assert (await client.request("system:health"))["agents"] == 2
        done = await client.request("agent:terminate", {"all": True})
        assert sorted(done["terminated"]) == ["a2", "a3"] and done["count"] == 2
        assert (await client.request("system:health"))["agents"] == 0
        listed = await client.request("agent:list", {"status": "terminated"})
        assert [a["agent_id"] for a in listed["agents"]] == ["a1", "a2", "a3"]
        assert (await client.request("agent:list", {"status": "active"}))["count"] == 0
        for data in ({}, {"agent_id": "a1", "all": True}, {"all": False}):
            assert (await error_of(client, "agent:terminate", data)).code == "validation_error"
    # terminated agents stay terminated after a restart
    async with running_daemon(short_tmp, **backend) as daemon, connected(daemon) as client:
        error = await error_of(client, "agent:send_message", {"agent_id": "a2", "message": "hi"})
        assert error.code == "agent_terminated"


# -- bad input ------------------------------------------------------------------------------


async def test_bad_spawn_input(daemon: Daemon, client: KsiClient) -> None:
    root = daemon.layout.root.parent
    before = files_under(root)
    stored_before = await stored_snapshot(daemon.settings)
    error = await error_of(client, "agent:spawn", {"profile": "no-such-profile"})
    assert error.code == "profile_not_found"
    assert "assistant" in error.details["available"]
    for bad in ("../x", "a/b", ".hidden", "x" * 129, "a..b"):
        error = await error_of(client, "agent:spawn", {"agent_id": bad})
        assert error.code == "validation_error", bad
        assert "agent_id" in error.details["fields"]
    assert files_under(root) == before  # nothing written for refused spawns
    assert await stored_snapshot(daemon.settings) == stored_before
    assert not (root / "x.json").exists() and not (daemon.layout.state_dir / "x.json").exists()

    await client.request("agent:spawn", {"agent_id": "dup", "profile": "assistant"})
    error = await error_of(client, "agent:spawn", {"agent_id": "dup", "profile": "assistant"})
    assert error.code == "agent_exists"
    # an id that already names a conversation is refused: the agent's conversation is its id
    await client.request("completion:async", {"conversation_id": "taken", "create": True, "prompt": "x"})
    error = await error_of(client, "agent:spawn", {"agent_id": "taken"})
    assert error.code == "conversation_exists" and "agent_id" in error.details["fields"]
    assert names(await stored_snapshot(daemon.settings), "state/agents/") == {"dup.json"}

    for data in ({"agent_id": "dup", "temperature": 5}, {"agent_id": "z", "prompt": "  "}, {"agent_id": "z", "bogus": 1}):
        assert (await error_of(client, "agent:spawn", data)).code == "validation_error"


async def test_messages_to_missing_agents_and_bad_fields(client: KsiClient) -> None:
    for event, data in (
        ("agent:send_message", {"agent_id": "ghost", "message": "hi"}),
        ("agent:info", {"agent_id": "ghost"}),
        ("agent:reset", {"agent_id": "ghost"}),
        ("agent:terminate", {"agent_id": "ghost"}),
        ("completion:async", {"agent_id": "ghost", "prompt": "hi"}),
    ):
        assert (await error_of(client, event, data)).code == "agent_not_found", event
    await client.request("agent:spawn", {"agent_id": "real", "profile": "assistant"})
    for data in ({"agent_id": "real", "message": ""}, {"agent_id": "real", "message": "x", "wait": -1},
                 {"agent_id": "../real", "message": "x"}, {"agent_id": "real"}):
        assert (await error_of(client, "agent:send_message", data)).code == "validation_error", data
    assert (await error_of(client, "agent:list", {"status": "sleeping"})).code == "validation_error"


# -- profiles -------------------------------------------------------------------------------


async def test_profiles_from_a_directory(short_tmp: Path) -> None:
    profiles = write_profiles(short_tmp / "profiles")
    async with running_daemon(short_tmp, profiles_dir=profiles) as daemon, connected(daemon) as client:
        listed = await client.request("agent:profiles")
        by_name = {p["name"]: p for p in listed["profiles"]}
        # the directory's profiles join the shipped ones
        assert set(by_name) == {"tester", "plain", "assistant", "coordinator", "reviewer"}
        assert by_name["plain"]["model"] == "echo/plain"
        assert by_name["tester"]["model"] == daemon.settings.default_model
        assert by_name["tester"]["description"] == "remembers things"
        assert [i["file"] for i in listed["invalid"]] == ["broken.yaml"]
        assert "sytem" in listed["invalid"][0]["reason"]

        await client.request("agent:spawn", {"agent_id": "p1", "profile": "tester"})
        info = await client.request("agent:info", {"agent_id": "p1"})
        assert (info["system"], info["temperature"]) == (TESTER_SYSTEM, 0.3)
        error = await error_of(client, "agent:spawn", {"profile": "broken"})
        assert error.code == "profile_not_found" and error.details["invalid"][0]["file"] == "broken.yaml"
        # a profile added while the daemon runs is found without a restart
        (profiles / "late.yaml").write_text("system: I came late.\nallowed_events: ['agent:*']\n")
        await client.request("agent:spawn", {"agent_id": "p2", "profile": "late"})
        info = await client.request("agent:info", {"agent_id": "p2"})
        assert (info["system"], info["allowed_events"]) == ("I came late.", ["agent:*"])


async def test_shipped_profiles_are_valid_and_packaged(client: KsiClient) -> None:
    shipped = ProfileLibrary(None).load()
    assert shipped.invalid == []
    assert {"assistant", "coordinator", "reviewer"} <= set(shipped.profiles)
    assert shipped.profiles["assistant"].model is None  # the daemon's default model answers
    assert "agent:send_message" in shipped.profiles["coordinator"].allowed_events
    listed = await client.request("agent:profiles")
    assert {"assistant", "coordinator", "reviewer"} <= {p["name"] for p in listed["profiles"]}
    assert listed["directory"] == str(shipped_profiles_dir())
    pyproject = (Path(__file__).parent.parent / "pyproject.toml").read_text()
    assert '"profiles/*.yaml", "profiles/*.md"' in pyproject
    suffixes = {p.suffix for p in shipped_profiles_dir().iterdir() if p.is_file()}
    assert suffixes <= {".yaml", ".md"}  # everything shipped is covered by the package data


# -- list, info, health ----------------------------------------------------------------------


async def test_list_and_info_show_queued_requests(stub_daemon: Daemon, stub: Any) -> None:
    async with connected(stub_daemon) as client:
        await client.request("agent:spawn", {"agent_id": "l1", "model": "openai/stub-x"})
        await client.request("agent:spawn", {"agent_id": "l2"})
        stub.enqueue(Reply(text="slow", delay=0.5))
        first = await send(client, "l1", "one", wait=False)
        second = await send(client, "l1", "two", wait=False)
        info = await client.request("agent:info", {"agent_id": "l1"})
        assert info["queued_requests"] == 2
        assert [r["request_id"] for r in info["requests"]] == [first["request_id"], second["request_id"]]
        assert info["model"] == "openai/stub-x"
        listed = await client.request("agent:list")
        assert [a["agent_id"] for a in listed["agents"]] == ["l1", "l2"] and listed["count"] == 2
        await client.request("completion:wait", {"request_id": second["request_id"], "timeout": 30})
        info = await client.request("agent:info", {"agent_id": "l1"})
        assert info["queued_requests"] == 0 and info["exchanges"] == 2
        listed = await client.request("agent:list")
        assert listed["agents"][0]["exchanges"] == 2
        assert (await client.request("system:health"))["agents"] == 2


async def test_concurrent_spawns_of_one_id(client: KsiClient) -> None:
    results = await asyncio.gather(
        *(client.request("agent:spawn", {"agent_id": "race", "profile": "assistant"}) for _ in range(5)),
        return_exceptions=True,
    )
    ok = [r for r in results if isinstance(r, dict)]
    refused = [r for r in results if isinstance(r, KsiError)]
    assert len(ok) == 1 and len(refused) == 4
    assert {e.code for e in refused} == {"agent_exists"}


async def test_summaries_go_with_their_conversation_on_reset_and_on_delete(short_tmp: Path, stub: Any,
                                                                            backend: dict[str, Any]) -> None:
    from tests.test_compaction import SMALL, answering, good, prompt, settings, settled

    stub.answer = answering(good)
    async with running_daemon(short_tmp, **settings(stub), **backend) as daemon, connected(daemon) as client:
        await client.request("agent:spawn", {"agent_id": "ann", "model": SMALL})
        for turn in range(1, 13):
            await send(client, "ann", prompt(turn))
            await settled(daemon)
        summaries = (await stored_snapshot(daemon.settings)).get("logs/summaries/ann.jsonl")
        assert summaries, "the conversation outgrew its window but no summary was written"

        await client.request("agent:reset", {"agent_id": "ann"})
        stored = await stored_snapshot(daemon.settings)
        assert stored.get("logs/summaries/ann-1.jsonl") == summaries  # moved with its exchanges
        assert "logs/summaries/ann.jsonl" not in stored
        result = await send(client, "ann", "turn 1 again")
        assert "summary_upto" not in result["history"]
        assert "Summary of exchanges" not in stub.messages(-1)[0]["content"]

        deleted = await client.request("conversation:delete", {"conversation_id": "ann-1"})
        assert "logs/summaries/ann-1.jsonl" in deleted["removed"]
        assert "logs/summaries/ann-1.jsonl" not in await stored_snapshot(daemon.settings)
        # a new conversation under the deleted id starts without the old one's summaries
        await complete(client, prompt="fresh", conversation_id="ann-1", create=True, model=SMALL)
        stats = await client.request("conversation:stats", {"conversation_id": "ann-1"})
        assert stats["compaction"]["summaries"] == 0
