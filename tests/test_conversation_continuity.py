"""Continuing a conversation anywhere: across models (with the answerers note), raw inputs
on disk, and many clients appending at once without losing or reordering exchanges."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from ksi_common.client import KsiClient
from ksi_common.records import IndexEntry
from ksi_daemon.daemon import Daemon
from ksi_daemon.services.conversations.history import answerers_note
from tests.conftest import complete, connected
from tests.stored import stored_index, stored_response

pytestmark = pytest.mark.backends

NOTE = "[Note: earlier replies came from:"


def chat(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(m["role"], m["content"]) for m in messages]


async def test_another_model_continues_with_the_history_and_learns_who_answered(stub_daemon: Daemon, stub: Any) -> None:
    prompts = [f"{'x' * 400} turn {i}" for i in range(1, 6)]
    models = ["openai/stub-a", "openai/stub-b", "openai/stub-a", "openai/stub-a", "openai/stub-a"]
    async with connected(stub_daemon) as client:
        results = [await complete(client, model=models[0], prompt=prompts[0], conversation_id="xm", create=True)]
        for model, prompt in zip(models[1:], prompts[1:], strict=True):
            results.append(await complete(client, model=model, prompt=prompt, conversation_id="xm"))

    # model B got exchange 1 as history; one answerer so far, so no note
    assert chat(stub.messages(1)) == [("user", prompts[0]), ("assistant", results[0]["content"]),
                                      ("user", prompts[1])]
    assert stub.requests[1]["model"] == "stub-b"
    # two answerers in the history shown: a short system note names them with their exchanges
    third = stub.messages(2)
    assert third[0] == {"role": "system",
                        "content": f"{NOTE} openai/stub-a (exchange 1); openai/stub-b (exchange 2).]"}
    assert chat(third[1:]) == [("user", prompts[0]), ("assistant", results[0]["content"]),
                               ("user", prompts[1]), ("assistant", results[1]["content"]), ("user", prompts[2])]
    assert stub.messages(4)[0]["content"] == f"{NOTE} openai/stub-a (exchanges 1, 3-4); openai/stub-b (exchange 2).]"

    # the index records who answered each exchange
    index = await stored_index(stub_daemon, "xm")
    assert [(line["n"], line["model"], line["provider"]) for line in index] == [
        (n, model, "openai") for n, model in enumerate(models, start=1)]
    # response files hold the raw input only: their size does not grow with the history sent
    sizes = []
    for result, prompt in zip(results, prompts, strict=True):
        lines = await stored_response(stub_daemon, result["response_id"])
        assert lines is not None
        assert [(line["type"], line.get("content")) for line in lines[:-1]] == [("user", prompt)]
        sizes.append(len(orjson.dumps(lines)))
    sent_last = sum(len(m["content"]) for m in stub.messages(4))
    assert sent_last > 4 * 400
    assert max(sizes) - min(sizes) < 100


def test_answerers_note_names_agents_and_stays_short() -> None:
    def entry(n: int, model: str, agent: str | None = None) -> IndexEntry:
        return IndexEntry(n=n, response_id=f"r{n}", model=model, agent_id=agent)

    assert answerers_note([entry(1, "m"), entry(2, "m")]) is None
    assert answerers_note([entry(1, "m"), entry(2, "m", "helper")]) == (
        f"{NOTE} m (exchange 1); helper via m (exchange 2).]")
    many = [entry(n, f"model-{n % 6}") for n in range(1, 61)]
    note = answerers_note(many)
    assert note is not None and "and 2 more" in note and note.count("...") == 4
    assert len(note) < 400


async def test_eight_clients_and_a_shared_conversation_lose_and_reorder_nothing(stub_daemon: Daemon, stub: Any) -> None:
    stub.hold = 0.005
    turns, shared_turns, clients = 4, 3, 8
    pushed: list[dict[str, Any]] = []
    async with connected(stub_daemon) as watcher:
        await watcher.request("monitor:subscribe", {"patterns": ["completion:result", "completion:error"]})

        async def collect() -> None:
            async for frame in watcher.pushes():
                pushed.append(frame)

        collector = asyncio.create_task(collect())

        async def own_turns(client: KsiClient, i: int) -> list[dict[str, Any]]:
            done = []
            for turn in range(1, turns + 1):
                done.append(await complete(client, prompt=f"c{i} turn {turn}", conversation_id=f"own-{i}", create=True))
            return done

        async def shared(client: KsiClient, i: int) -> list[dict[str, Any]]:
            acks = [await client.request("completion:async", {"prompt": f"c{i} shared {k}", "conversation_id": "shared",
                                                               "create": True}) for k in range(shared_turns)]
            return [await client.request("completion:wait", {"request_id": a["request_id"], "timeout": 30})
                    for a in acks]

        async def one_client(i: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
            async with KsiClient(stub_daemon.settings.socket) as client:
                return await asyncio.gather(own_turns(client, i), shared(client, i))

        outcomes = await asyncio.gather(*(one_client(i) for i in range(clients)))
        expected = clients * (turns + shared_turns)
        for _ in range(200):
            if len(pushed) >= expected:
                break
            await asyncio.sleep(0.02)
        collector.cancel()

    assert all(frame["event"] == "completion:result" for frame in pushed)
    assert len(pushed) == expected
    by_conversation: dict[str, list[dict[str, Any]]] = {}
    for frame in pushed:
        by_conversation.setdefault(frame["data"]["conversation_id"], []).append(frame["data"])
    for conversation_id, results in by_conversation.items():
        index = await stored_index(stub_daemon, conversation_id)
        assert [line["n"] for line in index] == list(range(1, len(index) + 1))
        # the index order is the order the results were emitted, and the exchange numbers agree
        assert [line["response_id"] for line in index] == [r["response_id"] for r in results]
        assert [r["exchange"] for r in results] == [line["n"] for line in index]
    assert len(by_conversation["shared"]) == clients * shared_turns
    for i, (_own, shared_results) in enumerate(outcomes):
        index = await stored_index(stub_daemon, f"own-{i}")
        assert len(index) == turns
        inputs = [(await stored_response(stub_daemon, line["response_id"]) or [{}])[0]["content"] for line in index]
        assert inputs == [f"c{i} turn {t}" for t in range(1, turns + 1)]
        # one client's shared requests keep their submission order within the shared conversation
        numbers = [r["exchange"] for r in shared_results]
        assert numbers == sorted(numbers)
    shared_inputs = [(await stored_response(stub_daemon, line["response_id"]) or [{}])[0]["content"]
                     for line in await stored_index(stub_daemon, "shared")]
    assert sorted(shared_inputs) == sorted(f"c{i} shared {k}" for i in range(clients) for k in range(shared_turns))
