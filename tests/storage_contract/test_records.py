"""The contract of the records kept beside conversations, on every backend: responses, agents,
consortia, traces, summaries, calibration and the request journal, each read back as written."""

from __future__ import annotations

import pytest

from ksi_common.summaries import Summary
from ksi_daemon.storage.models import AgentRecord
from ksi_daemon.storage.ports import AgentExists, Storage
from tests.storage_contract.conftest import Opener


async def test_responses_are_read_back_in_the_order_asked(storage: Storage) -> None:
    for rid in ("r-b", "r-a"):
        await storage.responses.write(rid, [{"v": 1, "type": "user", "content": f"q {rid}"},
                                            {"v": 1, "type": "assistant", "content": f"a {rid}"}])
    first, missing, second = await storage.responses.read_many(["r-a", "r-none", "r-b"])
    assert missing is None and first is not None and second is not None
    assert (first.content, second.content) == ("a r-a", "a r-b") and first.ok
    assert await storage.responses.read("r-none") is None
    assert await storage.responses.ids() == ["r-a", "r-b"]


async def test_an_agent_is_created_once_and_saved_over(storage: Storage, open_storage: Opener) -> None:
    record = AgentRecord(agent_id="ag", conversation_id="c", model="echo/x", metadata={"k": 1})
    await storage.agents.create(record)
    with pytest.raises(AgentExists) as taken:
        await storage.agents.create(record.model_copy(update={"model": "other"}))
    assert taken.value.agent_id == "ag"
    await storage.agents.save(record.model_copy(update={"status": "terminated"}))
    async with open_storage() as again:
        loaded = await again.agents.load("ag")
        assert loaded is not None and loaded.status == "terminated" and loaded.metadata == {"k": 1}
        assert [a.agent_id for a in await again.agents.load_all()] == ["ag"]
        assert await again.agents.load("nobody") is None


async def test_a_consortium_keeps_its_first_creation_time_and_can_be_removed(storage: Storage) -> None:
    first, replaced = await storage.consortia.save("team", {"members": ["a"]})
    assert not replaced
    second, replaced = await storage.consortia.save("team", {"members": ["a", "b"]})
    assert replaced and second["created"] == first["created"]
    assert (await storage.consortia.load("team"))["members"] == ["a", "b"]  # type: ignore[index]
    assert list(await storage.consortia.load_all()) == ["team"]
    assert await storage.consortia.remove("team") and not await storage.consortia.remove("team")
    assert await storage.consortia.load("team") is None


async def test_a_trace_is_read_back_line_by_line_in_order(storage: Storage) -> None:
    for i in range(5):
        await storage.traces.append("run-1", {"i": i}, durable=i == 4)
    assert [line["i"] for line in await storage.traces.read("run-1") or []] == [0, 1, 2, 3, 4]
    assert await storage.traces.read("run-none") is None
    assert await storage.traces.run_ids() == ["run-1"]


async def test_summaries_read_back_oldest_first_per_conversation(storage: Storage, open_storage: Opener) -> None:
    for upto in (2, 4):
        await storage.summaries.append(Summary(conversation_id="c", upto=upto, text=f"up to {upto}", tokens=3))
    await storage.summaries.append(Summary(conversation_id="other", upto=1, text="x"))
    async with open_storage() as again:
        assert [(s.upto, s.text) for s in await again.summaries.read("c")] == [(2, "up to 2"), (4, "up to 4")]
        assert await again.summaries.read("none") == []


async def test_calibration_is_replaced_whole(storage: Storage, open_storage: Opener) -> None:
    assert await storage.calibration.load() == {}
    await storage.calibration.save({"m": {"ratio": 1.2, "samples": 3, "tightened": False}})
    await storage.calibration.save({"n": {"ratio": 0.9, "samples": 1, "tightened": True}})
    async with open_storage() as again:
        assert await again.calibration.load() == {"n": {"ratio": 0.9, "samples": 1, "tightened": True}}


async def test_the_journal_keeps_each_requests_last_state_and_compacts(storage: Storage) -> None:
    storage.journal.record("q1", "c", "queued", model="echo/x")
    storage.journal.record("q2", "c", "queued", model="echo/x")
    storage.journal.record("q1", "c", "done", response_id="r1")
    states = {s["request_id"]: s for s in await storage.journal.states()}
    assert states["q1"]["status"] == "done" and states["q1"]["model"] == "echo/x"
    assert states["q1"]["response_id"] == "r1" and states["q2"]["status"] == "queued"
    await storage.journal.replace([states["q2"]])
    assert [s["request_id"] for s in await storage.journal.states()] == ["q2"]
