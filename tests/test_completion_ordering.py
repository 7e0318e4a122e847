"""Per-conversation order under pipelining, global and per-model concurrency limits, and the
queue lifecycle: status, wait, cancel and the events emitted."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from ksi_common.client import KsiClient
from ksi_daemon.daemon import Daemon
from tests.conftest import complete, connected, running_daemon, stub_settings
from tests.stub_openai import Reply, StubOpenAI

TIMEOUT = 30.0


async def pipeline(daemon: Daemon, requests: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Write every request in one go on one raw connection; return the replies by request order."""
    reader, writer = await asyncio.open_unix_connection(str(daemon.settings.socket), limit=16 * 1024 * 1024)
    try:
        payload = b"".join(
            orjson.dumps({"event": event, "data": data, "correlation_id": f"p-{i}"}) + b"\n"
            for i, (event, data) in enumerate(requests)
        )
        writer.write(payload)
        await writer.drain()
        replies: dict[str, dict[str, Any]] = {}
        while len(replies) < len(requests):
            line = await asyncio.wait_for(reader.readline(), TIMEOUT)
            assert line, "the daemon closed the connection"
            frame = orjson.loads(line)
            replies[frame["correlation_id"]] = frame
        return [replies[f"p-{i}"] for i in range(len(requests))]
    finally:
        writer.close()
        await writer.wait_closed()


async def wait_all(daemon: Daemon, acks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for ack in acks:
        assert "error" not in ack, ack
    waits = [("completion:wait", {"request_id": ack["data"]["request_id"], "timeout": TIMEOUT}) for ack in acks]
    results = await pipeline(daemon, waits)
    for result in results:
        assert "error" not in result, result
    return [result["data"] for result in results]


def user_inputs(body: dict[str, Any]) -> list[str]:
    return [m["content"] for m in body["messages"] if m["role"] == "user"]


def index_ids(daemon: Daemon, conversation_id: str) -> list[str]:
    lines = daemon.layout.index_file(conversation_id).read_bytes().splitlines()
    return [orjson.loads(line)["response_id"] for line in lines]


def check_order(daemon: Daemon, stub: Any, conversation_id: str, prompts: list[str], before: list[str],
                results: list[dict[str, Any]]) -> None:
    bodies = stub.requests[-len(prompts):]
    assert [user_inputs(body)[-1] for body in bodies] == prompts
    for position, body in enumerate(bodies):
        assert user_inputs(body) == [*before, *prompts[: position + 1]]
    assert [r["exchange"] for r in results] == list(range(len(before) + 1, len(before) + len(prompts) + 1))
    assert index_ids(daemon, conversation_id)[len(before):] == [r["response_id"] for r in results]


async def test_pipelined_requests_into_a_warm_conversation_run_in_arrival_order(stub_daemon: Daemon,
                                                                                 stub: Any) -> None:
    async with connected(stub_daemon) as client:
        await complete(client, prompt="start", conversation_id="warm", create=True)
    prompts = [f"message {i}" for i in range(20)]
    acks = await pipeline(stub_daemon, [("completion:async", {"prompt": p, "conversation_id": "warm"})
                                        for p in prompts])
    assert all(ack["data"]["conversation_id"] == "warm" for ack in acks)
    results = await wait_all(stub_daemon, acks)
    check_order(stub_daemon, stub, "warm", prompts, ["start"], results)


async def test_pipelined_requests_creating_a_conversation_run_in_arrival_order(stub_daemon: Daemon,
                                                                                stub: Any) -> None:
    prompts = [f"message {i}" for i in range(20)]
    acks = await pipeline(stub_daemon, [("completion:async", {"prompt": p, "conversation_id": "new", "create": True})
                                        for p in prompts])
    results = await wait_all(stub_daemon, acks)
    check_order(stub_daemon, stub, "new", prompts, [], results)


async def test_pipelined_requests_into_a_cold_conversation_run_in_arrival_order(short_tmp: Path,
                                                                                 stub: Any) -> None:
    settings = stub_settings(stub)
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        await complete(client, prompt="start", conversation_id="cold", create=True)
    prompts = [f"message {i}" for i in range(20)]
    async with running_daemon(short_tmp, **settings) as daemon:  # nothing of "cold" is in memory
        acks = await pipeline(daemon, [("completion:async", {"prompt": p, "conversation_id": "cold"})
                                       for p in prompts])
        results = await wait_all(daemon, acks)
        check_order(daemon, stub, "cold", prompts, ["start"], results)


async def test_conversations_run_in_parallel_within_the_global_limit(short_tmp: Path, stub: Any) -> None:
    stub.hold = 0.05
    async with running_daemon(short_tmp, **stub_settings(stub, max_concurrency=4)) as daemon:
        acks = await pipeline(daemon, [("completion:async", {"prompt": f"hi {i}", "conversation_id": f"c{i}",
                                                             "create": True}) for i in range(50)])
        results = await wait_all(daemon, acks)
    assert len(stub.requests) == 50
    assert 1 < stub.max_in_flight <= 4
    assert {r["content"] for r in results} == {f"stub answer to: hi {i}" for i in range(50)}


async def test_one_conversation_never_runs_two_requests_at_once(short_tmp: Path, stub: Any) -> None:
    stub.hold = 0.02
    async with running_daemon(short_tmp, **stub_settings(stub, max_concurrency=8)) as daemon:
        acks = await pipeline(daemon, [("completion:async", {"prompt": f"hi {i}", "conversation_id": "one",
                                                             "create": True}) for i in range(8)])
        await wait_all(daemon, acks)
    assert stub.max_in_flight == 1


async def test_a_per_model_limit_holds(short_tmp: Path, stub: Any) -> None:
    stub.hold = 0.03
    models = {"openai/stub-one": {"api_base": stub.api_base, "max_concurrency": 1}}
    async with running_daemon(short_tmp, **stub_settings(stub, max_concurrency=8, models=models)) as daemon:
        acks = await pipeline(daemon, [("completion:async", {"prompt": f"hi {i}", "conversation_id": f"m{i}",
                                                             "model": "openai/stub-one", "create": True})
                                       for i in range(8)])
        await wait_all(daemon, acks)
    assert len(stub.requests) == 8
    assert {body["model"] for body in stub.requests} == {"stub-one"}
    assert stub.max_in_flight == 1


async def test_a_model_at_its_limit_does_not_hold_up_other_models(short_tmp: Path, gated: Any) -> None:
    models = {"openai/stub-one": {"api_base": gated.api_base, "max_concurrency": 1}}
    async with running_daemon(short_tmp, **stub_settings(gated, max_concurrency=2, models=models)) as daemon:
        names = ["one0", "one1", "one2", "two"]
        async with connected(daemon) as client:  # warm conversations: submitted in arrival order
            for name in names:
                await complete(client, model="echo/x", prompt="hello", conversation_id=name, create=True)
        gated.gate.clear()
        pipelined = asyncio.create_task(pipeline(daemon, [
            ("completion:async", {"prompt": "hi", "conversation_id": name, "model": f"openai/stub-{name[:3]}"})
            for name in names]))
        # stub-one runs one at a time; the second global slot goes to stub-two meanwhile
        await until(lambda: len(gated.arrived) == 2, "two requests reach the provider at once")
        assert sorted(body["model"] for body in gated.arrived) == ["stub-one", "stub-two"]
        gated.gate.set()
        await wait_all(daemon, await pipelined)
    assert [body["model"] for body in gated.requests].count("stub-one") == 3


# -- queue lifecycle: status, wait, cancel, events ----------------------------------------------


class GatedStub(StubOpenAI):
    """The stub with a gate: requests are recorded as they arrive and answered once it is open."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.gate.set()
        self.arrived: list[dict[str, Any]] = []

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self.arrived.append(await request.json())
        await self.gate.wait()
        return await super()._chat(request)


@pytest.fixture
async def gated() -> Any:
    async with GatedStub() as server:
        yield server
        server.gate.set()


class AbortAwareStub(StubOpenAI):
    """The stub with its handler cancelled when the client hangs up, so an abort is visible."""

    def __init__(self) -> None:
        super().__init__()
        self.aborted = 0

    async def start(self) -> AbortAwareStub:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        try:
            return await super()._chat(request)
        except asyncio.CancelledError:
            self.aborted += 1
            raise


async def until(condition: Any, what: str, limit: float = 10.0) -> None:
    """Poll `condition` until it holds; fail after `limit` seconds (a bound, not a measurement)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while not condition():
        assert loop.time() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.01)


async def status_of(client: KsiClient, request_id: str) -> dict[str, Any]:
    return await client.request("completion:status", {"request_id": request_id})


async def next_event(client: KsiClient, name: str) -> dict[str, Any]:
    while True:
        push = await client.next_push(timeout=TIMEOUT)
        assert push is not None, "connection closed"
        if push["event"] == name:
            return push


async def test_status_reports_queued_running_and_done_with_positions(short_tmp: Path, gated: Any) -> None:
    stub = gated
    stub.gate.clear()
    async with running_daemon(short_tmp, **stub_settings(stub)) as daemon, connected(daemon) as client:
        acks = [await client.request("completion:async", {"prompt": f"p{i}", "conversation_id": "st",
                                                          "create": True}) for i in range(3)]
        assert [ack["status"] for ack in acks] == ["queued"] * 3
        assert [ack["queue_position"] for ack in acks] == [0, 1, 2]
        ids = [ack["request_id"] for ack in acks]
        await until(lambda: len(stub.arrived) == 1, "the first request reaches the stub")
        first, second, third = [await status_of(client, request_id) for request_id in ids]
        assert (first["status"], first["queue_position"]) == ("running", 0)
        assert (second["status"], second["queue_position"]) == ("queued", 1)
        assert (third["status"], third["queue_position"]) == ("queued", 2)
        assert first["conversation_id"] == "st" and first["model"] == "openai/stub-model"
        # a wait that ends before the request does replies with the status
        waited = await client.request("completion:wait", {"request_id": ids[1], "timeout": 0.01})
        assert waited["request_id"] == ids[1]
        assert waited["status"] == "queued" and waited["queue_position"] == 1
        waited = await client.request("completion:wait", {"request_id": ids[0], "timeout": 0})
        assert (waited["status"], waited["queue_position"]) == ("running", 0)
        stub.gate.set()
        results = [await client.request("completion:wait", {"request_id": i, "timeout": TIMEOUT}) for i in ids]
        done = await status_of(client, ids[2])
    assert [r["content"] for r in results] == ["stub answer to: p0", "stub answer to: p1", "stub answer to: p2"]
    assert (done["status"], done["queue_position"]) == ("done", 0)
    assert done["response_id"] == results[2]["response_id"]


async def test_status_of_a_failed_request(stub_daemon: Daemon, stub: Any) -> None:
    stub.enqueue(Reply(status=400))
    async with connected(stub_daemon) as client:
        ack = await client.request("completion:async", {"prompt": "bad"})
        reply = await client.send_frame("completion:wait", {"request_id": ack["request_id"], "timeout": TIMEOUT})
        status = await status_of(client, ack["request_id"])
    assert reply["error"]["code"] == "provider_error"
    assert reply["error"]["details"]["request_id"] == ack["request_id"]
    assert (status["status"], status["reason"], status["queue_position"]) == ("failed", "provider_error", 0)


async def test_unknown_request_ids(stub_daemon: Daemon) -> None:
    async with connected(stub_daemon) as client:
        for event in ("completion:status", "completion:wait", "completion:cancel"):
            reply = await client.send_frame(event, {"request_id": "req-doesnotexist"})
            assert reply["error"]["code"] == "request_not_found", event
            assert reply["error"]["details"]["request_id"] == "req-doesnotexist"


async def test_cancel_a_queued_request(short_tmp: Path, gated: Any) -> None:
    stub = gated
    stub.gate.clear()
    async with running_daemon(short_tmp, **stub_settings(stub)) as daemon, connected(daemon) as client, \
            connected(daemon) as watcher:
        await watcher.request("monitor:subscribe", {"patterns": ["completion:*"]})
        first = await client.request("completion:async", {"prompt": "slow one", "conversation_id": "cq",
                                                          "create": True})
        second = await client.request("completion:async", {"prompt": "cancel me", "conversation_id": "cq"})
        third = await client.request("completion:async", {"prompt": "keep me", "conversation_id": "cq"})
        cancelled = await client.request("completion:cancel", {"request_id": second["request_id"]})
        assert cancelled["cancelled"] is True
        assert cancelled["status"] == "cancelled"
        assert (await status_of(client, third["request_id"]))["queue_position"] == 1
        reply = await client.send_frame("completion:wait", {"request_id": second["request_id"], "timeout": 5})
        assert reply["error"]["code"] == "cancelled"
        push = await next_event(watcher, "completion:cancelled")
        assert push["data"]["request_id"] == second["request_id"]
        assert push["data"]["conversation_id"] == "cq"
        assert push["data"]["code"] == "cancelled"
        assert len(stub.arrived) <= 1  # nothing got past the first request meanwhile
        stub.gate.set()
        results = [await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": TIMEOUT})
                   for ack in (first, third)]
        again = await client.request("completion:cancel", {"request_id": second["request_id"]})
        finished = await client.request("completion:cancel", {"request_id": first["request_id"]})
        status = await status_of(client, second["request_id"])
        assert index_ids(daemon, "cq") == [r["response_id"] for r in results]
    assert again["cancelled"] is False and again["status"] == "cancelled"
    assert finished["cancelled"] is False and finished["status"] == "done"
    assert "response_id" not in status  # it never ran
    assert [user_inputs(body)[-1] for body in stub.requests] == ["slow one", "keep me"]
    assert user_inputs(stub.requests[-1]) == ["slow one", "keep me"]
    assert results[1]["exchange"] == 2


async def test_cancel_a_running_request_aborts_the_provider_call(short_tmp: Path) -> None:
    async with AbortAwareStub() as stub, running_daemon(short_tmp, **stub_settings(stub)) as daemon, \
            connected(daemon) as client:
        await client.request("monitor:subscribe", {"patterns": ["completion:cancelled"]})
        await complete(client, prompt="before", conversation_id="cr", create=True)
        stub.hold = 60.0  # far longer than any bound below: only an abort ends it in time
        ack = await client.request("completion:async", {"prompt": "abort me", "conversation_id": "cr"})
        await until(lambda: stub.in_flight == 1, "the request reaches the stub")
        assert (await status_of(client, ack["request_id"]))["status"] == "running"
        cancelled = await asyncio.wait_for(
            client.request("completion:cancel", {"request_id": ack["request_id"]}), TIMEOUT)
        assert cancelled["cancelled"] is True and cancelled["status"] == "cancelled"
        await until(lambda: stub.aborted == 1 and stub.in_flight == 0, "the stub sees the call aborted")
        reply = await client.send_frame("completion:wait", {"request_id": ack["request_id"], "timeout": 5})
        assert reply["error"]["code"] == "cancelled"
        push = await next_event(client, "completion:cancelled")
        assert push["data"]["request_id"] == ack["request_id"]
        status = await status_of(client, ack["request_id"])
        lines = [orjson.loads(line) for line in
                 daemon.layout.response_file(status["response_id"]).read_bytes().splitlines()]
        assert [line["type"] for line in lines] == ["user", "error"]
        assert lines[1]["code"] == "cancelled"
        assert len(index_ids(daemon, "cr")) == 1
        stub.hold = 0.0
        after = await complete(client, prompt="after", conversation_id="cr")
        assert user_inputs(stub.requests[-1]) == ["before", "after"]
        assert after["exchange"] == 2


async def test_cancelling_the_running_request_leaves_the_next_one_whole(short_tmp: Path) -> None:
    """The running request and the one queued behind it share their conversation's worker: the
    cancel ends the first only; the second runs, and is cancelled by its own cancel alone."""
    async with AbortAwareStub() as stub, running_daemon(short_tmp, **stub_settings(stub)) as daemon, \
            connected(daemon) as client:
        stub.hold = 60.0
        first = await client.request("completion:async", {"prompt": "abort me", "conversation_id": "cn",
                                                           "create": True})
        await until(lambda: stub.in_flight == 1, "the first request reaches the stub")
        second = await client.request("completion:async", {"prompt": "then me", "conversation_id": "cn"})
        cancelled = await client.request("completion:cancel", {"request_id": first["request_id"]})
        assert cancelled["cancelled"] is True
        await until(lambda: stub.aborted == 1 and stub.in_flight == 1, "the second request reaches the stub")
        assert (await status_of(client, second["request_id"]))["status"] == "running"
        stub.hold = 0.0
        # the second call is held too; a cancel of it, like any, must end it alone
        cancelled_again = await client.request("completion:cancel", {"request_id": second["request_id"]})
        assert cancelled_again["cancelled"] is True
        third = await complete(client, prompt="and me", conversation_id="cn")
        reply = await client.send_frame("completion:wait", {"request_id": first["request_id"], "timeout": 5})
        assert reply["error"]["code"] == "cancelled"
    assert third["content"] == "stub answer to: and me"
    assert third["exchange"] == 1  # the cancelled ones left nothing in the index
    assert stub.aborted == 2
    assert len(index_ids(daemon, "cn")) == 1


async def test_result_and_error_events_carry_ids_and_context(stub_daemon: Daemon, stub: Any) -> None:
    async with connected(stub_daemon) as client, connected(stub_daemon) as watcher:
        await watcher.request("monitor:subscribe", {"patterns": ["completion:result", "completion:error"]})
        ok = await client.send_frame("completion:async", {"prompt": "fine", "conversation_id": "ev",
                                                          "create": True})
        result = await next_event(watcher, "completion:result")
        stub.enqueue(Reply(status=401))
        bad = await client.send_frame("completion:async", {"prompt": "unauthorized", "conversation_id": "ev"})
        error = await next_event(watcher, "completion:error")
    for reply, push in ((ok, result), (bad, error)):
        assert push["data"]["request_id"] == reply["data"]["request_id"]
        assert push["data"]["conversation_id"] == "ev"
        assert push["context"]["event_id"] == push["event_id"]
        assert push["context"]["correlation_id"] == reply["correlation_id"]
        assert push["context"]["parent_event_id"]
    data = result["data"]
    assert data["content"] == "stub answer to: fine"
    assert set(data) >= {"request_id", "response_id", "conversation_id", "agent_id", "model", "content",
                         "finish_reason", "usage", "cost", "history", "attempts", "duration_ms"}
    assert error["data"]["code"] == "provider_error"
    assert error["data"]["message"]


async def test_a_cancel_arriving_while_the_exchange_is_written_is_too_late(stub_daemon: Daemon, stub: Any) -> None:
    store = stub_daemon.cache.store
    original = store.append_exchange
    writing = asyncio.Event()
    release = asyncio.Event()

    async def held_append(conversation_id: str, entry: Any, **parts: Any) -> None:
        writing.set()
        await asyncio.wait_for(release.wait(), TIMEOUT)
        await original(conversation_id, entry, **parts)

    async with connected(stub_daemon) as client:
        await complete(client, prompt="one", conversation_id="late", create=True)
        store.append_exchange = held_append  # type: ignore[method-assign]
        try:
            ack = await client.request("completion:async", {"prompt": "two", "conversation_id": "late"})
            await until(writing.is_set, "the exchange is being written")
            cancel = asyncio.create_task(client.request("completion:cancel", {"request_id": ack["request_id"]}))
            await until(lambda: stub_daemon.completion.requests.get(ack["request_id"]).job.task.cancelling() > 0,
                        "the cancel reaches the running request")
            release.set()
            cancelled = await asyncio.wait_for(cancel, TIMEOUT)
        finally:
            release.set()
            store.append_exchange = original  # type: ignore[method-assign]
        second = await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": TIMEOUT})
        third = await complete(client, prompt="three", conversation_id="late")
    assert cancelled["cancelled"] is False and cancelled["status"] == "done"
    assert second["exchange"] == 2
    index = [orjson.loads(line) for line in stub_daemon.layout.index_file("late").read_bytes().splitlines()]
    assert [line["n"] for line in index] == [1, 2, 3]
    assert [line["response_id"] for line in index][1:] == [second["response_id"], third["response_id"]]
    assert user_inputs(stub.requests[-1]) == ["one", "two", "three"]
    lines = [orjson.loads(line) for line in
             stub_daemon.layout.response_file(second["response_id"]).read_bytes().splitlines()]
    assert [line["type"] for line in lines] == ["user", "assistant"]


async def test_cancel_a_request_waiting_for_a_concurrency_slot(short_tmp: Path, gated: Any) -> None:
    stub = gated
    stub.gate.clear()
    async with running_daemon(short_tmp, **stub_settings(stub, max_concurrency=1)) as daemon, \
            connected(daemon) as client:
        busy = await client.request("completion:async", {"prompt": "busy", "conversation_id": "x", "create": True})
        await until(lambda: len(stub.arrived) == 1, "the first request runs")
        waiting = await client.request("completion:async", {"prompt": "waiting", "conversation_id": "y",
                                                            "create": True})
        status = await status_of(client, waiting["request_id"])
        assert (status["status"], status["queue_position"]) == ("queued", 0)  # first of its conversation
        cancelled = await client.request("completion:cancel", {"request_id": waiting["request_id"]})
        assert cancelled["cancelled"] is True
        stub.gate.set()
        await client.request("completion:wait", {"request_id": busy["request_id"], "timeout": TIMEOUT})
        later = await complete(client, prompt="later", conversation_id="y")
        health = await client.request("system:health")
    assert [user_inputs(body)[-1] for body in stub.requests] == ["busy", "later"]
    assert user_inputs(stub.requests[-1]) == ["later"]
    assert later["exchange"] == 1
    assert health["completions"]["queued"] == 0 and health["completions"]["running"] == 0


async def test_a_request_cancelled_while_queued_leaves_no_empty_conversation_behind(short_tmp: Path,
                                                                                       gated: Any) -> None:
    stub = gated
    stub.gate.clear()
    async with running_daemon(short_tmp, **stub_settings(stub, max_concurrency=1)) as daemon, \
            connected(daemon) as client:
        busy = await client.request("completion:async", {"prompt": "busy", "conversation_id": "x", "create": True})
        await until(lambda: len(stub.arrived) == 1, "the first request runs")
        waiting = await client.request("completion:async", {"prompt": "waiting"})  # the daemon names it
        named = await client.request("completion:async", {"prompt": "named", "conversation_id": "y", "create": True})
        for ack in (waiting, named):
            assert (await client.request("completion:cancel", {"request_id": ack["request_id"]}))["cancelled"]

        async def ids() -> set[str]:
            listed = await client.request("conversation:list", {})
            return {c["conversation_id"] for c in listed["conversations"]}

        gone = False
        for _ in range(200):
            gone = waiting["conversation_id"] not in await ids()
            if gone:
                break
            await asyncio.sleep(0.05)
        stub.gate.set()
        await client.request("completion:wait", {"request_id": busy["request_id"], "timeout": TIMEOUT})
        kept = await ids()
    assert gone  # the conversation made for the cancelled request went with it
    assert kept == {"x", "y"}  # one the client named stays


async def test_too_many_queued_requests_are_refused_with_a_retry_hint(short_tmp: Path, gated: Any) -> None:
    stub = gated
    stub.gate.clear()
    async with running_daemon(short_tmp, **stub_settings(stub, max_queued=3)) as daemon, \
            connected(daemon) as client:
        acks = [await client.request("completion:async", {"prompt": f"p{i}", "conversation_id": "full",
                                                          "create": True}) for i in range(3)]
        refused = await client.send_frame("completion:async", {"prompt": "one too many", "conversation_id": "full"})
        stub.gate.set()
        for ack in acks:
            await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": TIMEOUT})
        accepted = await complete(client, prompt="room again", conversation_id="full")
    assert refused["error"]["code"] == "overloaded"
    assert refused["error"]["details"]["retry_after"] > 0
    assert "one too many" not in [user_inputs(body)[-1] for body in stub.requests]
    assert accepted["exchange"] == 4
