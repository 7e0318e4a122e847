"""Conversation lifecycle with an injected clock: TTL (sliding), turn caps, archive, update,
list, stats and delete; every refusal leaves the files on disk as they were."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from ksi_common.client import KsiClient
from ksi_common.errors import KsiError
from ksi_common.timefmt import parse_ts
from ksi_daemon.daemon import Daemon
from tests.conftest import complete, connected, make_settings, stub_settings
from tests.stored import stored_index, stored_meta, stored_snapshot
from tests.stub_openai import Reply

pytestmark = pytest.mark.backends


class FakeClock:
    """Wall time that moves only when told to."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@asynccontextmanager
async def clocked_daemon(root: Path, stub: Any, clock: FakeClock, backend: dict[str, Any],
                         **overrides: Any) -> AsyncIterator[Daemon]:
    daemon = Daemon(make_settings(root, **stub_settings(stub, **backend, **overrides)), clock=clock)
    await daemon.start()
    try:
        yield daemon
    finally:
        await daemon.shutdown()


async def refused(client: KsiClient, code: str, event: str, data: dict[str, Any]) -> KsiError:
    with pytest.raises(KsiError) as caught:
        await client.request(event, data)
    assert caught.value.code == code, caught.value
    return caught.value


async def test_ttl_expires_slides_with_activity_and_differs_from_not_found(short_tmp: Path, stub: Any, backend: dict[str, Any]) -> None:
    clock = FakeClock()
    async with clocked_daemon(short_tmp, stub, clock, backend) as daemon, connected(daemon) as client:
        await complete(client, prompt="one", conversation_id="t", create=True)
        updated = await client.request("conversation:update", {"conversation_id": "t", "ttl": 100})
        assert updated["conversation"]["ttl"] == 100 and updated["updated"] == ["ttl"]
        clock.advance(60)
        second = await complete(client, prompt="two", conversation_id="t")
        meta = (await stored_meta(daemon, "t") or {})
        assert abs(parse_ts(meta["last_activity"]) - clock.now) < 0.01  # stamped by the injected clock
        clock.advance(60)  # 120 s after the first exchange, 60 after the last: still alive
        await complete(client, prompt="three", conversation_id="t")
        clock.advance(101)
        before = await stored_snapshot(daemon.settings)
        error = await refused(client, "conversation_expired", "completion:async", {"prompt": "four", "conversation_id": "t"})
        assert error.details["conversation_id"] == "t" and "expired_at" in error.details
        await refused(client, "conversation_not_found", "completion:async", {"prompt": "x", "conversation_id": "never"})
        assert await stored_snapshot(daemon.settings) == before

        shown = await client.request("conversation:show", {"conversation_id": "t"})
        assert shown["conversation"]["state"] == "expired" and len(shown["exchanges"]) == 3
        listed = await client.request("conversation:list", {"status": "expired"})
        assert [c["conversation_id"] for c in listed["conversations"]] == ["t"]
        assert second["exchange"] == 2

        await client.request("conversation:update", {"conversation_id": "t", "ttl": 1000})  # revives it
        await complete(client, prompt="four", conversation_id="t")
        await client.request("conversation:update", {"conversation_id": "t", "ttl": None})
        clock.advance(10**7)
        await complete(client, prompt="five", conversation_id="t")
        assert len(await stored_index(daemon, "t")) == 5


async def test_default_ttl_setting_applies_to_new_conversations(short_tmp: Path, stub: Any, backend: dict[str, Any]) -> None:
    clock = FakeClock()
    async with clocked_daemon(short_tmp, stub, clock, backend, default_ttl=50) as daemon, connected(daemon) as client:
        first = await complete(client, prompt="hi")
        conversation_id = first["conversation_id"]
        assert (await stored_meta(daemon, conversation_id) or {})["ttl"] == 50
        clock.advance(49)
        await complete(client, prompt="still here", conversation_id=conversation_id)
        clock.advance(51)
        await refused(client, "conversation_expired", "completion:async",
                      {"prompt": "late", "conversation_id": conversation_id})


async def test_turn_cap_makes_the_conversation_full(stub_daemon: Daemon, stub: Any) -> None:
    async with connected(stub_daemon) as client:
        await complete(client, prompt="one", conversation_id="cap", create=True)
        await client.request("conversation:update", {"conversation_id": "cap", "turn_cap": 2})
        await complete(client, prompt="two", conversation_id="cap")
        before = await stored_snapshot(stub_daemon.settings)
        error = await refused(client, "conversation_full", "completion:async", {"prompt": "three", "conversation_id": "cap"})
        assert error.details["turn_cap"] == 2
        assert await stored_snapshot(stub_daemon.settings) == before
        # a fork counts the exchanges it shares: forked at 2 with the same cap, it is full too
        fork = await client.request("conversation:fork", {"conversation_id": "cap"})
        await refused(client, "conversation_full", "completion:async",
                      {"prompt": "x", "conversation_id": fork["conversation_id"]})
        await client.request("conversation:update", {"conversation_id": "cap", "turn_cap": None})
        await complete(client, prompt="three", conversation_id="cap")


async def test_archive_refuses_until_set_active(stub_daemon: Daemon, stub: Any) -> None:
    async with connected(stub_daemon) as client:
        await complete(client, prompt="one", conversation_id="arc", create=True)
        archived = await client.request("conversation:archive", {"conversation_id": "arc"})
        assert archived["conversation"]["status"] == "archived"
        assert (await stored_meta(stub_daemon, "arc") or {})["status"] == "archived"
        before = await stored_snapshot(stub_daemon.settings)
        await refused(client, "conversation_archived", "completion:async", {"prompt": "two", "conversation_id": "arc"})
        assert await stored_snapshot(stub_daemon.settings) == before
        await client.request("conversation:update", {"conversation_id": "arc", "status": "active"})
        await complete(client, prompt="two", conversation_id="arc")


async def test_update_validates_and_keeps_exchange_totals(stub_daemon: Daemon, stub: Any) -> None:
    async with connected(stub_daemon) as client:
        await complete(client, prompt="one", conversation_id="up", create=True)
        for bad in ({"ttl": -1}, {"turn_cap": 0}, {"status": "deleted"}, {"colour": "red"}, {"tags": "x"}):
            await refused(client, "validation_error", "conversation:update", {"conversation_id": "up", **bad})
        await refused(client, "conversation_not_found", "conversation:update", {"conversation_id": "nope", "title": "t"})
        reply = await client.request("conversation:update", {"conversation_id": "up", "title": "Greeting",
                                                             "tags": ["a", "b", "a"]})
        assert reply["conversation"]["title"] == "Greeting" and reply["conversation"]["tags"] == ["a", "b"]
        stub.hold = 0.2
        ack = await client.request("completion:async", {"prompt": "two", "conversation_id": "up"})
        await client.request("conversation:update", {"conversation_id": "up", "title": "Renamed"})
        await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 30})
        await client.request("conversation:update", {"conversation_id": "up", "title": None})
    meta = (await stored_meta(stub_daemon, "up") or {})
    assert meta["title"] is None and meta["tags"] == ["a", "b"] and meta["exchanges"] == 2


async def test_list_filters_sorts_and_pages(short_tmp: Path, stub: Any, backend: dict[str, Any]) -> None:
    clock = FakeClock()
    async with clocked_daemon(short_tmp, stub, clock, backend) as daemon, connected(daemon) as client:
        for i, (model, tag) in enumerate([("openai/stub-a", "red"), ("openai/stub-b", "blue"),
                                          ("openai/stub-a", "blue"), ("echo/x", None)]):
            await complete(client, model=model, prompt=f"conversation {i} says {'needle' if i == 1 else 'hay'}",
                           conversation_id=f"l{i}", create=True)
            if tag:
                await client.request("conversation:update", {"conversation_id": f"l{i}", "tags": [tag]})
            clock.advance(10)
        since = (await client.request("conversation:show", {"conversation_id": "l2"}))["conversation"]["last_activity"]
        await client.request("conversation:archive", {"conversation_id": "l0"})

        async def ids(**filters: Any) -> list[str]:
            return [c["conversation_id"] for c in (await client.request("conversation:list", filters))["conversations"]]

        assert await ids() == ["l3", "l2", "l1", "l0"]  # most recent activity first
        assert await ids(tag="blue") == ["l2", "l1"]
        assert await ids(model="openai/stub-a") == ["l2", "l0"]
        assert await ids(model="openai/*") == ["l2", "l1", "l0"]
        assert await ids(status="archived") == ["l0"]
        assert await ids(status="active") == ["l3", "l2", "l1"]
        assert await ids(text="NEEDLE") == ["l1"]
        assert await ids(since=since) == ["l3", "l2"]
        page = await client.request("conversation:list", {"limit": 2, "offset": 1})
        assert [c["conversation_id"] for c in page["conversations"]] == ["l2", "l1"] and page["total"] == 4
        await refused(client, "validation_error", "conversation:list", {"since": "yesterday"})
        await refused(client, "validation_error", "conversation:list", {"limit": 0})


async def test_stats_count_tokens_models_files_and_duration(short_tmp: Path, stub: Any, backend: dict[str, Any]) -> None:
    clock = FakeClock()
    async with clocked_daemon(short_tmp, stub, clock, backend) as daemon, connected(daemon) as client:
        results = [await complete(client, model="openai/stub-a", prompt="one two three", conversation_id="st", create=True)]
        results.append(await complete(client, model="openai/stub-b", prompt="four", conversation_id="st"))
        results.append(await complete(client, model="openai/stub-a", prompt="five", conversation_id="st"))
        fork = await client.request("conversation:fork", {"conversation_id": "st", "at": 2})
        await complete(client, prompt="six", conversation_id=fork["conversation_id"])
        stats = await client.request("conversation:stats", {"conversation_id": "st"})
        fork_stats = await client.request("conversation:stats", {"conversation_id": fork["conversation_id"]})
    assert stats["exchanges"] == 3 and stats["own_exchanges"] == 3 and stats["inherited_exchanges"] == 0
    assert stats["tokens_in"] == sum(r["usage"]["prompt_tokens"] for r in results)
    assert stats["tokens_out"] == sum(r["usage"]["completion_tokens"] for r in results)
    assert stats["models"] == {"openai/stub-a": 2, "openai/stub-b": 1}
    assert stats["duration_s"] >= 0 and stats["first"] <= stats["last"]
    assert stats["files"] == {}
    assert (fork_stats["exchanges"], fork_stats["own_exchanges"], fork_stats["inherited_exchanges"]) == (3, 1, 2)
    assert fork_stats["models"] == {"openai/stub-b": 1}  # the fork continues with the model it branched from


async def test_delete_removes_exactly_that_conversation(stub_daemon: Daemon, stub: Any) -> None:
    async with connected(stub_daemon) as client:
        x = [await complete(client, prompt="x1", conversation_id="x", create=True),
             await complete(client, prompt="x2", conversation_id="x")]
        stub.enqueue(Reply(status=400))
        ack = await client.request("completion:async", {"prompt": "x fails", "conversation_id": "x"})
        with pytest.raises(KsiError):
            await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 30})
        failed = (await client.request("completion:status", {"request_id": ack["request_id"]}))["response_id"]
        await complete(client, prompt="y1", conversation_id="y", create=True)
        await client.request("conversation:fork", {"conversation_id": "x", "at": 1, "new_id": "fx"})
        fx = await complete(client, prompt="fx own", conversation_id="fx")
        await client.request("conversation:fork", {"conversation_id": "y", "new_id": "fy"})
        fy = await complete(client, prompt="fy own", conversation_id="fy")

        before = await stored_snapshot(stub_daemon.settings)
        reply = await client.request("conversation:delete", {"conversation_id": "x"})
        after = await stored_snapshot(stub_daemon.settings)
        expected = {f"logs/responses/{r['response_id']}.jsonl" for r in x} | {
            f"logs/responses/{failed}.jsonl", "logs/conversations/x.jsonl", "state/conversations/x.json"}
        assert set(before) - set(after) == expected
        assert sorted(reply["removed"]) == sorted(expected)
        assert reply["orphaned_forks"] == ["fx"]
        assert all(after[name] == before[name] for name in after)  # nothing else changed
        await refused(client, "conversation_not_found", "conversation:show", {"conversation_id": "x"})
        await refused(client, "conversation_not_found", "completion:async", {"prompt": "?", "conversation_id": "x"})

        # the fork of the deleted conversation keeps working with its own exchanges
        shown = await client.request("conversation:show", {"conversation_id": "fx"})
        assert shown["missing_parent"] == "x"
        assert [(e["n"], e["response_id"]) for e in shown["exchanges"]] == [(2, fx["response_id"])]
        await complete(client, prompt="fx again", conversation_id="fx")
        assert [m["content"] for m in stub.messages() if m["role"] == "user"] == ["fx own", "fx again"]

        # deleting a fork leaves its parent untouched
        fy_files = {f"logs/responses/{fy['response_id']}.jsonl", "logs/conversations/fy.jsonl",
                    "state/conversations/fy.json"}
        before = await stored_snapshot(stub_daemon.settings)
        await client.request("conversation:delete", {"conversation_id": "fy"})
        assert await stored_snapshot(stub_daemon.settings) == {k: v for k, v in before.items() if k not in fy_files}
        assert fy_files <= set(before)
        await complete(client, prompt="y2", conversation_id="y")
        assert [m["content"] for m in stub.messages() if m["role"] == "user"] == ["y1", "y2"]


async def test_delete_cancels_requests_in_flight_and_removes_their_files(stub_daemon: Daemon, stub: Any) -> None:
    async with connected(stub_daemon) as client:
        await complete(client, prompt="one", conversation_id="busy", create=True)
        stub.hold = 2.0
        running = await client.request("completion:async", {"prompt": "slow", "conversation_id": "busy"})
        queued = await client.request("completion:async", {"prompt": "behind", "conversation_id": "busy"})
        await asyncio.sleep(0.3)
        reply = await client.request("conversation:delete", {"conversation_id": "busy"})
        assert reply["cancelled_requests"] == 2
        for ack in (running, queued):
            status = await client.request("completion:status", {"request_id": ack["request_id"]})
            assert status["status"] == "cancelled"
    stored = await stored_snapshot(stub_daemon.settings)
    leftovers = [name for name, value in stored.items()
                 if name.startswith("logs/responses/") and '"busy"' in (value if isinstance(value, str) else value.decode())]
    assert leftovers == []
    assert "logs/conversations/busy.jsonl" not in stored and "state/conversations/busy.json" not in stored
