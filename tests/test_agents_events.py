"""Events agents write into their replies: extraction, permission, dispatch, feedback, depth limit."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import structlog

from ksi_common.client import KsiClient
from ksi_daemon.context import EventContext
from ksi_daemon.daemon import Daemon
from ksi_daemon.services.agents.events import FEEDBACK_HEADER, extract_events, is_allowed
from tests.conftest import connected, running_daemon, stub_settings
from tests.stored import stored_response
from tests.stub_openai import StubOpenAI

pytestmark = pytest.mark.backends

PROFILES = {
    "talker.yaml": "system: You are a talker.\nallowed_events: ['agent:send_message', 'agent:info']\n",
    "quiet.yaml": "system: You are quiet.\n",
    "pinger.yaml": "system: You are a pinger.\nallowed_events: ['agent:*']\n",
}


def event(name: str, **data: Any) -> str:
    return json.dumps({"event": name, "data": data})


# -- extraction (pure) --------------------------------------------------------------------------


def test_extract_inline_and_fenced_in_order() -> None:
    text = (
        'First I ask b: {"event": "agent:send_message", "data": {"agent_id": "b", "message": "hi {there}"}}\n'
        "then:\n```json\n"
        '{"event": "agent:info", "data": {"agent_id": "b"}}\n'
        "```\nand a list ```json\n"
        '[{"event": "agent:list"}, {"event": "agent:profiles", "data": {}}]\n```'
    )
    found, malformed = extract_events(text)
    assert [(f.event, f.data) for f in found] == [
        ("agent:send_message", {"agent_id": "b", "message": "hi {there}"}),
        ("agent:info", {"agent_id": "b"}),
        ("agent:list", {}),
        ("agent:profiles", {}),
    ]
    assert malformed == []


def test_extract_leaves_other_json_alone_and_does_not_look_inside_events() -> None:
    text = (
        'Config: {"name": "x", "event": "not-an-event-object"} and {"a": {"event": "agent:list"}} '
        + json.dumps({"event": "agent:send_message",
                      "data": {"agent_id": "b", "message": event("system:shutdown")}})
    )
    found, malformed = extract_events(text)
    assert [f.event for f in found] == ["agent:send_message"]  # the nested one travels as text
    assert malformed == []


def test_extract_reports_malformed_events() -> None:
    text = (
        'broken {"event": "agent:send_message", "data": {"agent_id": "b", "message": }} '
        'wrong types {"event": 7, "data": {}} {"event": "agent:info", "data": [1]} '
        'good {"event": "agent:list", "data": {}} '
        'code { not json at all }'
    )
    found, malformed = extract_events(text)
    assert [f.event for f in found] == ["agent:list"]
    reasons = [m.reason for m in malformed]
    assert len(reasons) == 3
    assert reasons[0].startswith("invalid JSON")
    assert "`event` must be a non-empty string" in reasons[1]
    assert "must be a JSON object" in reasons[2]


def test_extract_caps_events_per_reply() -> None:
    found, malformed = extract_events(" ".join(event("agent:list") for _ in range(20)), limit=16)
    assert len(found) == 16 and len(malformed) == 4


def test_allowed_patterns_deny_by_default() -> None:
    assert not is_allowed("agent:send_message", [])
    assert is_allowed("agent:send_message", ["agent:*"])
    assert is_allowed("agent:send_message", ["agent:send_message"])
    assert not is_allowed("system:shutdown", ["agent:*", "completion:async"])
    assert is_allowed("system:shutdown", ["*"])


# -- in a daemon --------------------------------------------------------------------------------


@asynccontextmanager
async def agents_daemon(root: Path, stub: StubOpenAI, backend: dict[str, Any] | None = None,
                        **overrides: Any) -> AsyncIterator[Daemon]:
    profiles = root / "profiles"
    profiles.mkdir()
    for name, text in PROFILES.items():
        (profiles / name).write_text(text)
    async with running_daemon(root, **stub_settings(stub, profiles_dir=profiles, **(backend or {}), **overrides)) as daemon:
        yield daemon


async def settle(daemon: Daemon, timeout: float = 30.0) -> None:
    """Until no completion is queued or running and no reply's events are being acted on."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    quiet = 0
    while quiet < 5:
        busy = daemon.completion.requests.live() or daemon.agents.acting
        quiet = 0 if busy else quiet + 1
        assert loop.time() < deadline, "the daemon did not settle"
        await asyncio.sleep(0.02)


def last_user(body: dict[str, Any]) -> str:
    return [m["content"] for m in body["messages"] if m["role"] == "user"][-1]


def requests_with(stub: StubOpenAI, text: str) -> list[dict[str, Any]]:
    return [r for r in stub.requests if text in last_user(r)]


async def index_of(daemon: Daemon, conversation_id: str) -> list[Any]:
    return await daemon.storage.conversations.entries(conversation_id)


async def spawn(client: KsiClient, agent_id: str, profile: str) -> None:
    await client.request("agent:spawn", {"agent_id": agent_id, "profile": profile})


async def test_allowed_message_reaches_b_marked_from_a(short_tmp: Path, stub: StubOpenAI, backend: dict[str, Any]) -> None:
    async with agents_daemon(short_tmp, stub, backend) as daemon, connected(daemon) as client:
        await spawn(client, "a", "talker")
        await spawn(client, "b", "quiet")
        seen: list[tuple[str, dict[str, Any], EventContext]] = []
        daemon.router.listen("agent:send_message", lambda n, d, c: seen.append((n, d, c)))
        stub.enqueue("I will ask b.\n```json\n" + event("agent:send_message", agent_id="b", message="hello from a")
                     + "\n```")
        await client.request("agent:send_message", {"agent_id": "a", "message": "talk to b", "wait": True})
        await settle(daemon)

        to_b = requests_with(stub, "hello from a")
        assert len(to_b) == 1
        assert last_user(to_b[0]) == "[from a] hello from a"
        assert to_b[0]["messages"][0] == {"role": "system", "content": "You are quiet."}
        b_index = await index_of(daemon, "b")
        assert len(b_index) == 1 and b_index[0].agent_id == "b"
        b_lines = (await stored_response(daemon, b_index[0].response_id) or [{}])[0]
        assert b_lines["from_agent"] == "a"
        # the emitted event carries a's id and one more hop of depth
        agent_hops = [c for _n, _d, c in seen if c.agent_id == "a"]
        assert len(agent_hops) == 1 and agent_hops[0].depth == 1

        feedback = requests_with(stub, FEEDBACK_HEADER)
        assert len(feedback) == 1
        text = last_user(feedback[0])
        assert "1. agent:send_message: ok" in text and '"status": "queued"' in text
        a_index = await index_of(daemon, "a")
        assert [e.is_feedback for e in a_index] == [False, True]


async def test_denied_event_is_not_emitted_and_reported(short_tmp: Path, stub: StubOpenAI, backend: dict[str, Any]) -> None:
    async with agents_daemon(short_tmp, stub, backend) as daemon, connected(daemon) as client:
        await spawn(client, "a", "talker")
        await spawn(client, "b", "quiet")
        emitted: list[str] = []
        for name in ("system:shutdown", "agent:terminate"):
            daemon.router.listen(name, lambda n, d, c: emitted.append(n))
        stub.enqueue(event("system:shutdown") + " and " + event("agent:terminate", all=True)
                     + " and " + event("agent:info", agent_id="b"))
        await client.request("agent:send_message", {"agent_id": "a", "message": "go", "wait": True})
        await settle(daemon)

        assert emitted == []
        assert not daemon.shutting_down
        assert (await client.request("system:health"))["agents"] == 2
        feedback = requests_with(stub, FEEDBACK_HEADER)
        assert len(feedback) == 1
        lines = last_user(feedback[0]).splitlines()
        assert lines[1].startswith("1. system:shutdown: denied")
        assert lines[2].startswith("2. agent:terminate: denied")
        assert lines[3].startswith('3. agent:info: ok {"agent_id": "b"')


async def test_event_errors_and_malformed_json_are_reported(short_tmp: Path, stub: StubOpenAI, backend: dict[str, Any]) -> None:
    async with agents_daemon(short_tmp, stub, backend) as daemon, connected(daemon) as client:
        await spawn(client, "a", "talker")
        await spawn(client, "b", "quiet")
        stub.enqueue(
            'Trying: {"event": "agent:send_message", "data": {"agent_id": "b", "message": }}\n'
            + event("agent:send_message", agent_id="ghost", message="anyone?") + "\n"
            + event("agent:send_message", agent_id="b")
        )
        await client.request("agent:send_message", {"agent_id": "a", "message": "go", "wait": True})
        await settle(daemon)

        assert await index_of(daemon, "b") == []  # nothing reached b
        feedback = requests_with(stub, FEEDBACK_HEADER)
        assert len(feedback) == 1
        text = last_user(feedback[0])
        assert "1. agent:send_message: error agent_not_found" in text
        assert "2. agent:send_message: error validation_error" in text
        assert "malformed event at char 8, ignored: invalid JSON" in text
        health = await client.request("system:health")
        assert health["status"] == "healthy"


async def test_agent_messages_never_wait(short_tmp: Path, stub: StubOpenAI, backend: dict[str, Any]) -> None:
    async with agents_daemon(short_tmp, stub, backend) as daemon, connected(daemon) as client:
        await spawn(client, "a", "talker")
        await spawn(client, "b", "quiet")
        stub.hold = 0.3  # b's answer takes a while; a's event must not wait for it
        stub.enqueue(event("agent:send_message", agent_id="b", message="slowly", wait=True))
        await client.request("agent:send_message", {"agent_id": "a", "message": "go", "wait": True})
        await settle(daemon)
        text = last_user(requests_with(stub, FEEDBACK_HEADER)[0])
        assert '"status": "queued"' in text and "stub answer" not in text


async def test_feedback_is_left_out_of_later_history(short_tmp: Path, stub: StubOpenAI, backend: dict[str, Any]) -> None:
    async with agents_daemon(short_tmp, stub, backend) as daemon, connected(daemon) as client:
        await spawn(client, "a", "talker")
        await spawn(client, "b", "quiet")
        acting = event("agent:info", agent_id="b")
        stub.enqueue(acting)
        await client.request("agent:send_message", {"agent_id": "a", "message": "look at b", "wait": True})
        await settle(daemon)
        assert len(requests_with(stub, FEEDBACK_HEADER)) == 1
        await client.request("agent:send_message", {"agent_id": "a", "message": "next", "wait": True})
        sent = stub.messages(-1)
        assert [m["role"] for m in sent] == ["system", "user", "assistant", "user"]
        assert [m["content"] for m in sent[1:]] == ["look at b", acting, "next"]
        assert not any(FEEDBACK_HEADER in m["content"] for m in sent)
        assert [e.is_feedback for e in await index_of(daemon, "a")] == [False, True, False]


async def test_depth_limit_stops_ping_pong(short_tmp: Path, backend: dict[str, Any]) -> None:
    def answer(messages: list[dict[str, Any]]) -> str:
        me = "a" if messages[0]["content"].endswith("(a)") else "b"
        other = "b" if me == "a" else "a"
        return event("agent:send_message", agent_id=other, message=f"ping from {me}")

    async with StubOpenAI(answer=answer) as stub, \
            agents_daemon(short_tmp, stub, backend, max_event_depth=2) as daemon, connected(daemon) as client:
        for name in ("a", "b"):
            await client.request("agent:spawn", {"agent_id": name, "profile": "pinger",
                                                 "system": f"You are a pinger ({name})"})
        with structlog.testing.capture_logs() as logs:
            await client.request("agent:send_message", {"agent_id": "a", "message": "start", "wait": True})
            await settle(daemon)
            await asyncio.sleep(0.3)
            await settle(daemon)
        # depth 0: a's answer; depth 1: b's message and a's feedback; depth 2: two of each, not acted on
        assert len(stub.requests) == 1 + 2 + 4
        stops = [entry for entry in logs if entry["event"] == "agent_event_depth_limit"]
        assert len(stops) == 4 and {entry["depth"] for entry in stops} == {2}
        assert (await client.request("system:health"))["completions"]["queued"] == 0


async def test_depth_zero_disables_agent_events(short_tmp: Path, stub: StubOpenAI, backend: dict[str, Any]) -> None:
    async with agents_daemon(short_tmp, stub, backend, max_event_depth=0) as daemon, connected(daemon) as client:
        await spawn(client, "a", "talker")
        await spawn(client, "b", "quiet")
        stub.enqueue(event("agent:send_message", agent_id="b", message="hi"))
        await client.request("agent:send_message", {"agent_id": "a", "message": "go", "wait": True})
        await settle(daemon)
        assert len(stub.requests) == 1
        assert await index_of(daemon, "b") == []


async def test_events_from_terminated_or_unknown_agents_are_ignored(short_tmp: Path, stub: StubOpenAI, backend: dict[str, Any]) -> None:
    async with agents_daemon(short_tmp, stub, backend) as daemon, connected(daemon) as client:
        await spawn(client, "b", "quiet")
        # a reply in a plain conversation (no agent) is never scanned
        stub.enqueue(event("agent:send_message", agent_id="b", message="hi"))
        ack = await client.request("completion:async", {"prompt": "x"})
        await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 30})
        await settle(daemon)
        assert len(stub.requests) == 1 and await index_of(daemon, "b") == []


async def test_a_spawned_agent_gets_no_more_permissions_than_its_spawner(short_tmp: Path, stub: StubOpenAI, backend: dict[str, Any]) -> None:
    profiles = {"spawner.yaml": "system: You spawn.\nallowed_events: ['agent:spawn', 'agent:info']\n",
                "wide.yaml": "system: Wide.\nallowed_events: ['*', 'agent:info', 'system:shutdown']\n"}
    async with agents_daemon(short_tmp, stub, backend) as daemon, connected(daemon) as client:
        for name, text in profiles.items():
            (short_tmp / "profiles" / name).write_text(text)
        await spawn(client, "boss", "spawner")
        stub.enqueue(event("agent:spawn", agent_id="child", profile="wide"))
        await client.request("agent:send_message", {"agent_id": "boss", "message": "spawn one", "wait": True})
        await settle(daemon)
        child = await client.request("agent:info", {"agent_id": "child"})
        direct = await client.request("agent:spawn", {"agent_id": "direct", "profile": "wide"})
        direct_info = await client.request("agent:info", {"agent_id": direct["agent_id"]})
    assert child["spawned_by"] == "boss"
    assert child["allowed_events"] == ["agent:info"]
    assert direct_info["allowed_events"] == ["*", "agent:info", "system:shutdown"]
