"""The event bus on its own: registration, listeners and patterns, context propagation."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
from pydantic import Field

from ksi_common.client import KsiClient
from ksi_common.errors import KsiError
from ksi_daemon.context import EventContext
from ksi_daemon.daemon import Daemon
from ksi_daemon.events import EventData, NoData, Text
from ksi_daemon.router import Router, matches
from tests.conftest import connected, running_daemon


class EchoData(EventData):
    text: Text = Field(description="what to echo")
    times: int = Field(default=1, description="how many times")


async def echo(data: EchoData, _context: EventContext) -> dict[str, Any]:
    return {"text": data.text * data.times}


async def empty(_data: NoData, _context: EventContext) -> dict[str, Any]:
    return {}


Seen = list[tuple[str, dict[str, Any], EventContext]]


def recorder(seen: Seen) -> Any:
    def listener(name: str, data: dict[str, Any], context: EventContext) -> None:
        seen.append((name, data, context))
    return listener


def names(seen: Seen) -> list[str]:
    return [name for name, _data, _context in seen]


# -- registration ---------------------------------------------------------------


async def test_register_then_request_validates_and_answers() -> None:
    router = Router()
    router.register("demo:echo", echo, EchoData, "echoes")
    assert await router.request("demo:echo", {"text": "ab", "times": 2}, EventContext.root()) == {"text": "abab"}
    with pytest.raises(KsiError) as caught:
        await router.request("demo:echo", {"times": 2}, EventContext.root())
    assert caught.value.code == "validation_error"
    assert "text" in caught.value.details["fields"]


async def test_unregister_removes_the_handler() -> None:
    router = Router()
    unregister = router.register("demo:echo", echo, EchoData, "echoes")
    unregister()
    with pytest.raises(KsiError) as caught:
        await router.request("demo:echo", {"text": "a"}, EventContext.root())
    assert caught.value.code == "unknown_event"
    assert [route.name for route in router.events()] == []
    # the name is free again
    router.register("demo:echo", echo, EchoData, "echoes again")
    assert router.describe("demo:echo")["description"] == "echoes again"


async def test_duplicate_register_is_refused() -> None:
    router = Router()
    router.register("demo:echo", echo, EchoData, "echoes")
    with pytest.raises(ValueError):
        router.register("demo:echo", empty, NoData, "other")
    # the first handler is untouched
    assert await router.request("demo:echo", {"text": "x"}, EventContext.root()) == {"text": "x"}


async def test_unknown_event_suggests_close_names() -> None:
    router = Router()
    for name in ("demo:echo", "demo:list", "other:thing"):
        router.register(name, empty, NoData, name)
    with pytest.raises(KsiError) as caught:
        router.route("demo:ecko")
    assert caught.value.code == "unknown_event"
    assert caught.value.details["similar"][0] == "demo:echo"
    assert "other:thing" not in caught.value.details["similar"]


async def test_a_huge_unknown_name_is_cut_in_the_error_and_gets_no_suggestions() -> None:
    router = Router()
    router.register("demo:echo", empty, NoData, "demo:echo")
    with pytest.raises(KsiError) as caught:
        router.route("demo:echo" + "x" * 100_000)
    assert caught.value.code == "unknown_event" and caught.value.details["similar"] == []
    assert len(caught.value.message) < 200 and "100009 characters" in caught.value.message
    with pytest.raises(KsiError) as caught:  # a name of the longest shown length still gets them
        router.route("demo:ech" + "o" * 92)
    assert "100 characters" not in caught.value.message and "..." not in caught.value.message


def test_events_and_describe() -> None:
    router = Router()
    router.register("b:two", empty, NoData, "two")
    router.register("a:one", echo, EchoData, "one")
    router.register("b:three", empty, NoData, "three")
    assert [r.name for r in router.events()] == ["a:one", "b:three", "b:two"]
    assert [r.name for r in router.events("b")] == ["b:three", "b:two"]
    assert [r.name for r in router.events("b:*")] == ["b:three", "b:two"]
    assert router.events("c") == []
    description = router.describe("a:one")
    assert description["event"] == "a:one"
    assert description["description"] == "one"
    assert description["fields"]["text"]["required"] is True
    assert description["fields"]["text"]["type"] == "str"
    assert description["fields"]["times"] == {
        "type": "int", "required": False, "description": "how many times", "default": 1,
    }


# -- listeners --------------------------------------------------------------------


@pytest.mark.parametrize(("pattern", "event", "expected"), [
    ("*", "system:health", True),
    ("system:*", "system:health", True),
    ("system:*", "systemx:health", False),
    ("system:*", "monitor:subscribe", False),
    ("system:health", "system:health", True),
    ("system:health", "system:healthy", False),
    ("completion:*", "completion:result", True),
])
def test_matches(pattern: str, event: str, expected: bool) -> None:
    assert matches(pattern, event) is expected


def test_listen_exact_namespace_and_all() -> None:
    router = Router()
    exact: Seen = []
    namespace: Seen = []
    everything: Seen = []
    router.listen("a:one", recorder(exact))
    router.listen("a:*", recorder(namespace))
    router.listen("*", recorder(everything))
    context = EventContext.root()
    for name in ("a:one", "a:two", "b:one", "ab:one"):
        router.emit(name, {"n": name}, context)
    assert names(exact) == ["a:one"]
    assert names(namespace) == ["a:one", "a:two"]
    assert names(everything) == ["a:one", "a:two", "b:one", "ab:one"]
    assert exact[0][1] == {"n": "a:one"}


def test_remover_stops_delivery() -> None:
    router = Router()
    seen_exact: Seen = []
    seen_pattern: Seen = []
    remove_exact = router.listen("a:one", recorder(seen_exact))
    remove_pattern = router.listen("a:*", recorder(seen_pattern))
    router.emit("a:one", {}, EventContext.root())
    remove_exact()
    remove_pattern()
    router.emit("a:one", {}, EventContext.root())
    assert len(seen_exact) == 1
    assert len(seen_pattern) == 1
    # removing twice is harmless
    remove_exact()
    remove_pattern()


def test_same_listener_on_two_patterns_removed_independently() -> None:
    router = Router()
    seen: Seen = []
    listener = recorder(seen)
    remove_first = router.listen("a:*", listener)
    router.listen("*", listener)
    remove_first()
    router.emit("a:x", {}, EventContext.root())
    assert names(seen) == ["a:x"]


def test_failing_listener_does_not_stop_the_others() -> None:
    router = Router()
    before: Seen = []
    after: Seen = []
    router.listen("a:one", recorder(before))

    def broken(_name: str, _data: dict[str, Any], _context: EventContext) -> None:
        raise RuntimeError("listener bug")

    router.listen("a:one", broken)
    router.listen("*", broken)
    router.listen("a:one", recorder(after))
    router.listen("a:*", recorder(after))
    router.emit("a:one", {}, EventContext.root())
    assert names(before) == ["a:one"]
    assert names(after) == ["a:one", "a:one"]


@pytest.mark.parametrize("pattern", ["a:x", "a:*", "*"])
def test_listener_may_remove_itself_while_called(pattern: str) -> None:
    router = Router()
    seen: Seen = []
    removers: list[Any] = []

    def once(name: str, data: dict[str, Any], context: EventContext) -> None:
        seen.append((name, data, context))
        removers[0]()

    removers.append(router.listen(pattern, once))
    other: Seen = []
    router.listen(pattern, recorder(other))
    router.emit("a:x", {}, EventContext.root())
    router.emit("a:x", {}, EventContext.root())
    assert names(seen) == ["a:x"]
    # the listener after it is still called for the event during which it left
    assert names(other) == ["a:x", "a:x"]


async def test_request_tells_listeners_with_its_context() -> None:
    router = Router()
    router.register("demo:echo", echo, EchoData, "echoes")
    seen: Seen = []
    router.listen("demo:*", recorder(seen))
    context = EventContext.root(correlation_id="c-1", agent_id="agent-7")
    await router.request("demo:echo", {"text": "hi"}, context)
    assert len(seen) == 1
    name, data, received = seen[0]
    assert (name, data) == ("demo:echo", {"text": "hi"})
    assert received is context
    # a request that fails validation is not announced
    with pytest.raises(KsiError):
        await router.request("demo:echo", {"text": "hi", "bogus": 1}, context)
    assert len(seen) == 1


# -- context --------------------------------------------------------------------


def test_context_child_links_to_its_parent() -> None:
    root = EventContext.root(correlation_id="c-9", agent_id="a-1")
    child = root.child()
    grandchild = child.child(agent_id="a-2", depth=1)
    assert root.event_id.startswith("evt-") and root.parent_event_id is None
    assert child.event_id != root.event_id
    assert child.parent_event_id == root.event_id
    assert child.correlation_id == "c-9" and child.agent_id == "a-1"
    assert grandchild.parent_event_id == child.event_id
    assert (grandchild.agent_id, grandchild.depth, grandchild.correlation_id) == ("a-2", 1, "c-9")
    assert grandchild.to_wire() == {
        "event_id": grandchild.event_id,
        "correlation_id": "c-9",
        "parent_event_id": child.event_id,
        "agent_id": "a-2",
    }


def test_emitted_event_carries_its_context() -> None:
    router = Router()
    seen: Seen = []
    router.listen("*", recorder(seen))
    cause = EventContext.root(correlation_id="c-2", agent_id="a-3")
    router.emit("demo:result", {"ok": True}, cause.child())
    (_name, _data, context), = seen
    assert context.parent_event_id == cause.event_id
    assert context.correlation_id == "c-2"
    assert context.agent_id == "a-3"
    assert context.event_id not in (None, cause.event_id)


async def test_socket_request_context_reaches_listeners(daemon: Daemon, client: KsiClient) -> None:
    seen: Seen = []
    remove = daemon.router.listen("system:health", recorder(seen))
    try:
        reply = await client.send_frame("system:health")
        assert len(seen) == 1
        _name, _data, context = seen[0]
        assert context.correlation_id == reply["correlation_id"]
        assert context.event_id.startswith("evt-")
        assert context.parent_event_id is None
        assert context.agent_id is None
    finally:
        remove()
    await client.send_frame("system:health")
    assert len(seen) == 1


async def test_handler_emitting_a_child_event(daemon: Daemon, client: KsiClient) -> None:
    async def cause(_data: NoData, context: EventContext) -> dict[str, Any]:
        child = context.child()
        daemon.router.emit("test:effect", {"from": "cause"}, child)
        return {"child": child.event_id, "parent": context.event_id}

    seen: Seen = []
    removers = [
        daemon.router.register("test:cause", cause, NoData, "emits test:effect"),
        daemon.router.listen("test:effect", recorder(seen)),
    ]
    try:
        reply = await asyncio.wait_for(client.send_frame("test:cause"), 10)
        (_name, data, context), = seen
        assert data == {"from": "cause"}
        assert context.event_id == reply["data"]["child"]
        assert context.parent_event_id == reply["data"]["parent"]
        assert context.correlation_id == reply["correlation_id"]
    finally:
        for remove in removers:
            remove()


# -- self-description through the socket: system:discover and system:help ---------


async def test_discover_lists_every_registered_event(daemon: Daemon, client: KsiClient) -> None:
    reply = await client.request("system:discover")
    registered = {route.name: route.description for route in daemon.router.events()}
    assert reply["events"] == registered
    assert reply["count"] == len(registered)
    for name in ("system:health", "system:discover", "system:help", "system:shutdown",
                 "monitor:subscribe", "monitor:unsubscribe"):
        assert reply["events"][name].strip()


async def test_discover_sees_events_registered_later(daemon: Daemon, client: KsiClient) -> None:
    unregister = daemon.router.register("test:late", empty, NoData, "registered after start")
    try:
        reply = await client.request("system:discover", {"namespace": "test"})
        assert reply == {"events": {"test:late": "registered after start"}, "count": 1}
    finally:
        unregister()
    assert (await client.request("system:discover", {"namespace": "test"}))["count"] == 0


async def test_discover_filters_by_namespace(client: KsiClient) -> None:
    reply = await client.request("system:discover", {"namespace": "monitor"})
    assert set(reply["events"]) == {"monitor:subscribe", "monitor:unsubscribe"}
    assert reply["count"] == 2
    system = await client.request("system:discover", {"namespace": "system:*"})
    assert set(system["events"]) == {"system:health", "system:discover", "system:help", "system:config", "system:cluster",
                                      "system:shutdown"}
    assert (await client.request("system:discover", {"namespace": "nothing"}))["count"] == 0


async def test_help_describes_fields(client: KsiClient) -> None:
    reply = await client.request("system:help", {"event": "monitor:subscribe"})
    assert reply["event"] == "monitor:subscribe"
    assert reply["description"]
    patterns = reply["fields"]["patterns"]
    assert patterns["required"] is False
    assert patterns["default"] == ["*"]
    assert patterns["type"] == "list[str]"
    assert patterns["description"]
    fields = (await client.request("system:help", {"event": "completion:async"}))["fields"]
    assert fields["prompt"]["type"] == "str | None"
    assert fields["messages"]["type"] == "list[InputMessage] | None"
    assert fields["metadata"]["type"] == "dict[str, Any]"
    reply = await client.request("system:help", {"event": "system:help"})
    assert reply["fields"]["event"]["required"] is True
    assert reply["fields"]["event"]["type"] == "str"
    assert "default" not in reply["fields"]["event"]
    assert (await client.request("system:help", {"event": "system:health"}))["fields"] == {}


async def test_help_for_every_discovered_event(client: KsiClient) -> None:
    events = (await client.request("system:discover"))["events"]
    for name, description in events.items():
        reply = await client.request("system:help", {"event": name})
        assert reply["event"] == name
        assert reply["description"] == description
        for field in reply["fields"].values():
            assert {"type", "required", "description"} <= set(field)
            assert field["required"] or "default" in field


async def test_help_for_unknown_event(client: KsiClient) -> None:
    reply = await client.send_frame("system:help", {"event": "monitor:subscrbe"})
    assert reply["error"]["code"] == "unknown_event"
    assert "monitor:subscribe" in reply["error"]["details"]["similar"]


async def test_health_reports_counts(daemon: Daemon, client: KsiClient) -> None:
    health = await client.request("system:health")
    assert health["status"] == "healthy"
    assert health["connections"] == 1
    assert health["subscriptions"] == 0
    assert health["pid"] == os.getpid()
    assert health["uptime"] >= 0
    assert isinstance(health["version"], str)
    async with KsiClient(daemon.settings.socket) as second:
        await second.request("monitor:subscribe", {"patterns": ["*"]})
        health = await client.request("system:health")
        assert (health["connections"], health["subscriptions"]) == (2, 1)


def _statm_descriptors() -> int:
    """Descriptors of this process open on its own /proc statm file."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") == f"/proc/{os.getpid()}/statm"
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return count


async def test_health_reports_the_memory_resident_now_and_keeps_no_descriptor_after_stop(short_tmp: Path) -> None:
    async with running_daemon(short_tmp) as daemon, connected(daemon) as client:
        first = (await client.request("system:health"))["memory_rss_mb"]
        ballast = bytearray(os.urandom(1024)) * (64 * 1024)  # 64 MB, every page written
        grown = (await client.request("system:health"))["memory_rss_mb"]
        assert grown - first >= 60, (first, grown)  # read afresh at each reply, not remembered
        del ballast
        assert _statm_descriptors() == 1  # one kept open, not one per reply
        system = daemon.system
    assert _statm_descriptors() == 0
    assert system.memory.megabytes() > 0  # a reply while draining still has a figure
    assert _statm_descriptors() == 0
