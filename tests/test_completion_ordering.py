"""Per-conversation order under pipelining, and global and per-model concurrency limits."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson

from ksi_daemon.daemon import Daemon
from tests.conftest import complete, connected, running_daemon, stub_settings

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


async def test_a_model_at_its_limit_does_not_hold_up_other_models(short_tmp: Path, stub: Any) -> None:
    stub.hold = 0.2
    models = {"openai/stub-one": {"api_base": stub.api_base, "max_concurrency": 1}}
    async with running_daemon(short_tmp, **stub_settings(stub, max_concurrency=2, models=models)) as daemon:
        names = ["one0", "one1", "one2", "two"]
        async with connected(daemon) as client:  # warm conversations: submitted in arrival order
            for name in names:
                await complete(client, model="echo/x", prompt="hello", conversation_id=name, create=True)
        acks = await pipeline(daemon, [("completion:async", {"prompt": "hi", "conversation_id": name,
                                                             "model": f"openai/stub-{name[:3]}"})
                                       for name in names])
        await wait_all(daemon, acks)
    models_seen = [body["model"] for body in stub.requests]
    # stub-one runs one at a time; the free global slot goes to stub-two while stub-one waits
    assert "stub-two" in models_seen[:2], models_seen
    assert stub.max_in_flight == 2
