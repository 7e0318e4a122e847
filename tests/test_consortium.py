"""Consortium completions through a real daemon: members, arbiter and conversation on local stubs."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from ksi_common.client import KsiClient
from ksi_common.errors import KsiError
from ksi_daemon.daemon import Daemon
from tests.conftest import complete, connected, running_daemon
from tests.stored import names, stored_index, stored_items, stored_response, stored_snapshot
from tests.stub_openai import Reply, StubOpenAI

pytestmark = pytest.mark.backends

Answer = Callable[[list[dict[str, Any]]], str]


def last_user(messages: list[dict[str, Any]]) -> str:
    return next((str(m["content"]) for m in reversed(messages) if m["role"] == "user"), "")


def member(name: str) -> Answer:
    return lambda messages: f"{name} answers: {last_user(messages)}"


def verdict(confidence: float, synthesis: str = "the consensus", **more: Any) -> str:
    return json.dumps({"synthesis": synthesis, "confidence": confidence, "dissent": "", "refinement_areas": [],
                       "needs_iteration": confidence < 0.8, "ranking": [1], **more})


def confident_judge(messages: list[dict[str, Any]]) -> str:
    return verdict(0.95)


@asynccontextmanager
async def consortium_daemon(root: Path, answers: dict[str, Answer], backend: dict[str, Any], **overrides: Any
                            ) -> AsyncIterator[tuple[Daemon, dict[str, StubOpenAI]]]:
    """A daemon whose models `openai/NAME...` are each answered by their own local stub."""
    async with AsyncExitStack() as stack:
        stubs = {name: await stack.enter_async_context(StubOpenAI(answer=answer)) for name, answer in answers.items()}
        models = {f"openai/{name}*": {"api_base": stub.api_base} for name, stub in stubs.items()}
        daemon = await stack.enter_async_context(running_daemon(root, models=models, **backend, **overrides))
        yield daemon, stubs


DEFAULT_STUBS = {"ma": member("A"), "mb": member("B"), "mc": member("C"), "judge": confident_judge}


async def save(client: KsiClient, name: str = "duo", **definition: Any) -> dict[str, Any]:
    data = {"name": name, "members": ["openai/ma:2", "openai/mb"], "arbiter": "openai/judge", **definition}
    return await client.request("consortium:save", data)


async def index_lines(daemon: Daemon, conversation_id: str) -> list[dict[str, Any]]:
    return await stored_index(daemon, conversation_id)


async def response_lines(daemon: Daemon, response_id: str) -> list[dict[str, Any]]:
    return await stored_response(daemon, response_id) or []


async def trace(daemon: Daemon, run_id: str) -> list[dict[str, Any]]:
    return (await stored_items(daemon.settings)).get(f"logs/consortium/{run_id}.jsonl", [])


async def call_files(daemon: Daemon, run_id: str) -> list[list[dict[str, Any]]]:
    """The response records of a run's member and arbiter calls."""
    found = []
    for name, lines in (await stored_items(daemon.settings)).items():
        if name.startswith("logs/responses/") and lines and lines[0].get("run_id") == run_id:
            found.append(lines)
    return found


async def stored_under(daemon: Daemon, prefix: str) -> set[str]:
    return names(await stored_snapshot(daemon.settings), prefix)


# -- continuity -----------------------------------------------------------------


async def test_two_prompts_keep_the_conversation(short_tmp: Path, backend: dict[str, Any]) -> None:
    async with consortium_daemon(short_tmp, DEFAULT_STUBS, backend) as (daemon, stubs), connected(daemon) as client:
        await save(client)
        stubs["judge"].enqueue(verdict(0.95, "Hello Alice, the dentist."), verdict(0.9, "Your name is Alice."))
        first = await complete(client, model="consortium/duo", prompt="My name is Alice and I am a dentist")
        second = await complete(client, model="consortium/duo", prompt="What is my name?",
                                conversation_id=first["conversation_id"])

    assert first["content"] == "Hello Alice, the dentist."
    assert second["content"] == "Your name is Alice."
    assert second["conversation_id"] == first["conversation_id"]
    assert first["model"] == second["model"] == "consortium/duo"
    assert first["run_id"] != second["run_id"]

    # every member instance and the arbiter saw the first exchange before the second prompt
    earlier = [{"role": "user", "content": "My name is Alice and I am a dentist"},
               {"role": "assistant", "content": "Hello Alice, the dentist."}]
    second_calls = [*stubs["ma"].requests[2:], *stubs["mb"].requests[1:], *stubs["judge"].requests[1:]]
    assert len(stubs["ma"].requests) == 4 and len(stubs["mb"].requests) == 2 and len(stubs["judge"].requests) == 2
    for body in second_calls:
        messages = [m for m in body["messages"] if m["role"] != "system"]
        assert messages[:2] == earlier, body["model"]
    for body in [*stubs["ma"].requests[2:], *stubs["mb"].requests[1:]]:
        assert body["messages"][-1] == {"role": "user", "content": "What is my name?"}
    assert "What is my name?" in stubs["judge"].requests[1]["messages"][-1]["content"]
    assert "A answers: What is my name?" in stubs["judge"].requests[1]["messages"][-1]["content"]

    # the conversation's index holds exactly the two consortium answers, with their runs
    lines = await index_lines(daemon, first["conversation_id"])
    assert [line["n"] for line in lines] == [1, 2]
    assert [line["response_id"] for line in lines] == [first["response_id"], second["response_id"]]
    assert [line["run_id"] for line in lines] == [first["run_id"], second["run_id"]]
    assert {line["model"] for line in lines} == {"consortium/duo"}
    assert first["response_id"].startswith("consortium-duo-")

    # member and arbiter calls: own response files, linked to the conversation, not in its index
    calls = await call_files(daemon, second["run_id"])
    assert sorted((c[-1]["role"], c[-1]["model"]) for c in calls) == [
        ("arbiter", "openai/judge"), ("member", "openai/ma"), ("member", "openai/ma"), ("member", "openai/mb")]
    indexed = {line["response_id"] for line in lines}
    for call in calls:
        assert all(line["run_id"] == second["run_id"] and line["iteration"] == 1 for line in call)
        assert all(line["conversation_id"] == first["conversation_id"] for line in call)
        assert call[-1]["type"] == "assistant"
    member_ids = {n.removesuffix(".jsonl") for n in await stored_under(daemon, "logs/responses/")
                  if n.startswith("openai-m")}
    assert len(member_ids) == 6 and not member_ids & indexed

    # usage and cost are the sum of the run's calls
    summed = sum(call[-1]["usage"]["total_tokens"] for call in calls)
    assert second["usage"]["total_tokens"] == summed > 0
    assert (await response_lines(daemon, second["response_id"]))[-1]["run_id"] == second["run_id"]


async def test_result_of_a_run_can_be_traced(short_tmp: Path, backend: dict[str, Any]) -> None:
    async with consortium_daemon(short_tmp, DEFAULT_STUBS, backend) as (daemon, _stubs), connected(daemon) as client:
        await save(client)
        result = await complete(client, model="consortium/duo", prompt="Hi")
        traced = await client.request("consortium:trace", {"run_id": result["run_id"]})
    assert traced["status"] == "ok"
    assert traced["conversation_id"] == result["conversation_id"]
    assert traced["request_id"] == result["request_id"]
    [round_one] = traced["iterations"]
    assert sorted((m["model"], m["instance"]) for m in round_one["members"]) == [
        ("openai/ma", 1), ("openai/ma", 2), ("openai/mb", 1)]
    assert all(m["ok"] and m["usage"]["total_tokens"] > 0 and m["duration_ms"] > 0 for m in round_one["members"])
    assert round_one["arbiter"]["confidence"] == 0.95
    assert round_one["arbiter"]["arbiter_parse"] == "json"
    assert round_one["outcome"]["reason"] == "confident"
    assert traced["final"]["content"] == result["content"]
    assert traced["outcome"] == "confident"
    assert traced["final"]["usage"] == result["usage"]
    assert [e["event"] for e in traced["events"]][0] == "start"
    assert [e["event"] for e in traced["events"]][-1] == "final"


async def test_a_run_ending_below_its_threshold_is_listed_as_such_not_as_ok(short_tmp: Path,
                                                                              backend: dict[str, Any]) -> None:
    stubs = {**DEFAULT_STUBS, "judge": lambda _messages: verdict(0.4, synthesis="a doubtful consensus")}
    async with consortium_daemon(short_tmp, stubs, backend) as (daemon, _stubs), connected(daemon) as client:
        await save(client, "doubtful", confidence_threshold=0.9, max_iterations=1)
        doubtful = await complete(client, model="consortium/doubtful", prompt="Hard one")
        traced = await client.request("consortium:trace", {"run_id": doubtful["run_id"]})
        assert (traced["status"], traced["outcome"]) == ("ok", "below_threshold")  # answered, but not confidently
        listed = await client.request("consortium:runs", {})
        assert listed["total"] == 1 and listed["runs"][0]["run_id"] == doubtful["run_id"]
        assert {key: listed["runs"][0][key] for key in ("outcome", "confidence", "threshold", "iterations")} == {
            "outcome": "below_threshold", "confidence": 0.4, "threshold": 0.9, "iterations": 1}
        await complete(client, model="consortium/doubtful", prompt="Again", conversation_id=doubtful["conversation_id"])
        listed = await client.request("consortium:runs", {"limit": 1})
        assert listed["total"] == 2 and len(listed["runs"]) == 1
        assert listed["runs"][0]["conversation_id"] == doubtful["conversation_id"]
        assert listed["runs"][0]["started"] >= (await client.request("consortium:runs", {"offset": 1}))["runs"][0]["started"]
        with pytest.raises(KsiError) as refused:
            await client.request("consortium:runs", {"limit": 0})
        assert refused.value.code == "validation_error"


async def test_inline_consortium_and_the_next_prompt(short_tmp: Path, backend: dict[str, Any]) -> None:
    inline = {"members": ["openai/ma", "openai/mb"], "arbiter": "openai/judge", "system": "Be brief."}
    async with consortium_daemon(short_tmp, DEFAULT_STUBS, backend) as (daemon, stubs), connected(daemon) as client:
        first = await complete(client, consortium=inline, prompt="one", system="You are kind.")
        second = await complete(client, consortium=inline, prompt="two", conversation_id=first["conversation_id"])
    assert first["model"] == second["model"] == "consortium/inline"
    system = stubs["mb"].requests[-1]["messages"][0]
    assert system == {"role": "system", "content": "You are kind.\n\nBe brief."}
    assert [m["content"] for m in stubs["mb"].requests[-1]["messages"][1:]] == ["one", "the consensus", "two"]
    assert len(await index_lines(daemon, first["conversation_id"])) == 2


# -- iterations -----------------------------------------------------------------


async def test_low_confidence_iterates_once_more(short_tmp: Path, backend: dict[str, Any]) -> None:
    async with consortium_daemon(short_tmp, DEFAULT_STUBS, backend) as (daemon, stubs), connected(daemon) as client:
        await save(client, members=["openai/ma", "openai/mb"])
        stubs["judge"].enqueue(verdict(0.5, "draft", refinement_areas=["name the year"]), verdict(0.9, "better"))
        result = await complete(client, model="consortium/duo", prompt="When was Rome founded?")
    assert result["content"] == "better"
    assert result["consortium"]["iterations"] == 2
    assert len(stubs["ma"].requests) == len(stubs["mb"].requests) == 2
    # the second round shows members the draft and what to refine, after the original request
    messages = stubs["ma"].requests[1]["messages"]
    assert messages[-3] == {"role": "user", "content": "When was Rome founded?"}
    assert messages[-2] == {"role": "assistant", "content": "draft"}
    assert "name the year" in messages[-1]["content"]
    # the arbiter's second round sees its earlier synthesis
    assert "draft" in stubs["judge"].requests[1]["messages"][-1]["content"]
    outcomes = [e for e in await trace(daemon, result["run_id"]) if e["event"] == "iteration"]
    assert [(e["iteration"], e["confidence"], e["reason"]) for e in outcomes] == [
        (1, 0.5, "below_threshold"), (2, 0.9, "confident")]
    assert {c[-1]["iteration"] for c in await call_files(daemon, result["run_id"])} == {1, 2}


async def test_min_iterations_are_respected(short_tmp: Path, backend: dict[str, Any]) -> None:
    async with consortium_daemon(short_tmp, DEFAULT_STUBS, backend) as (daemon, stubs), connected(daemon) as client:
        await save(client, members=["openai/ma"], min_iterations=2, max_iterations=4)
        result = await complete(client, model="consortium/duo", prompt="x")
    assert result["consortium"]["iterations"] == 2
    assert len(stubs["judge"].requests) == 2
    reasons = [e["reason"] for e in await trace(daemon, result["run_id"]) if e["event"] == "iteration"]
    assert reasons == ["min_iterations", "confident"]


async def test_max_iterations_stop_a_never_confident_arbiter(short_tmp: Path, backend: dict[str, Any]) -> None:
    stubs_answers = {**DEFAULT_STUBS, "judge": lambda messages: verdict(0.2, "unsure")}
    async with consortium_daemon(short_tmp, stubs_answers, backend) as (daemon, stubs), connected(daemon) as client:
        await save(client, members=["openai/ma"], max_iterations=3, confidence_threshold=90)
        result = await complete(client, model="consortium/duo", prompt="x")
    assert result["consortium"]["iterations"] == 3
    assert result["content"] == "unsure"
    assert len(stubs["judge"].requests) == 3 and len(stubs["ma"].requests) == 3
    final = (await trace(daemon, result["run_id"]))[-1]
    assert final["event"] == "final" and final["iterations"] == 3
    assert [e["reason"] for e in await trace(daemon, result["run_id"]) if e["event"] == "iteration"][-1] == "max_iterations"


# -- judging --------------------------------------------------------------------


async def test_rank_mode_returns_the_chosen_member_answer_verbatim(short_tmp: Path, backend: dict[str, Any]) -> None:
    async with consortium_daemon(short_tmp, DEFAULT_STUBS, backend) as (daemon, stubs), connected(daemon) as client:
        await save(client, members=["openai/ma", "openai/mb", "openai/mc"], judging="rank")
        stubs["judge"].enqueue(verdict(0.9, "my own words", ranking=[3, 1, 2]))
        result = await complete(client, model="consortium/duo", prompt="pick me")
    assert result["content"] == "C answers: pick me"
    arbiter = next(e for e in await trace(daemon, result["run_id"]) if e["event"] == "arbiter")
    assert arbiter["chosen"] == 3 and arbiter["ranking"] == [3, 1, 2]
    assert "Rank the member answers" in stubs["judge"].requests[0]["messages"][0]["content"]


async def test_arbiter_prose_is_read_by_the_fallback_parser(short_tmp: Path, backend: dict[str, Any]) -> None:
    async with consortium_daemon(short_tmp, DEFAULT_STUBS, backend) as (daemon, stubs), connected(daemon) as client:
        await save(client, max_iterations=1)
        stubs["judge"].enqueue("Both members agree: the answer is 42.")
        result = await complete(client, model="consortium/duo", prompt="x")
        stubs["judge"].enqueue('Here you go:\n```json\n{"synthesis": "fenced", "confidence": 85}\n```')
        fenced = await complete(client, model="consortium/duo", prompt="y", conversation_id=result["conversation_id"])
    assert result["content"] == "Both members agree: the answer is 42."
    assert result["consortium"]["arbiter_parse"] == "fallback"
    arbiter = next(e for e in await trace(daemon, result["run_id"]) if e["event"] == "arbiter")
    assert arbiter["arbiter_parse"] == "fallback" and arbiter["confidence"] == 0.0
    assert arbiter["raw"] == "Both members agree: the answer is 42."
    assert fenced["content"] == "fenced" and fenced["consortium"]["arbiter_parse"] == "json"
    assert fenced["consortium"]["confidence"] == 0.85


async def test_arbiter_failure_falls_back_to_a_member_answer(short_tmp: Path, backend: dict[str, Any]) -> None:
    async with consortium_daemon(short_tmp, DEFAULT_STUBS, backend) as (daemon, stubs), connected(daemon) as client:
        await save(client, members=["openai/mb", "openai/ma"])
        stubs["judge"].enqueue(*[Reply(status=500)] * 3)
        result = await complete(client, model="consortium/duo", prompt="x")
    assert result["content"] == "B answers: x"
    assert result["consortium"]["fallback"]["reason"] == "arbiter_failed"
    arbiter = next(e for e in await trace(daemon, result["run_id"]) if e["event"] == "arbiter")
    assert arbiter["ok"] is False and arbiter["code"] == "provider_error" and len(arbiter["attempts"]) == 3


# -- failing members ------------------------------------------------------------


async def test_a_slow_and_a_broken_member_are_skipped(short_tmp: Path, backend: dict[str, Any]) -> None:
    async with consortium_daemon(short_tmp, DEFAULT_STUBS, backend) as (daemon, stubs), connected(daemon) as client:
        await save(client, members=["openai/ma", "openai/mb", "openai/mc"], timeout=0.5)
        stubs["ma"].enqueue(Reply(delay=1.5), Reply(delay=1.5))
        stubs["mb"].enqueue(*[Reply(status=500)] * 3)
        started = time.perf_counter()
        result = await complete(client, model="consortium/duo", prompt="x")
        elapsed = time.perf_counter() - started
    assert result["consortium"]["members_answered"] == 1
    assert elapsed < 1.4  # the slow member was not waited for
    judged = stubs["judge"].requests[0]["messages"][-1]["content"]
    assert "C answers: x" in judged and "A answers" not in judged and "B answers" not in judged
    members = {e["model"]: e for e in await trace(daemon, result["run_id"]) if e["event"] == "member"}
    assert members["openai/ma"]["ok"] is False and members["openai/ma"]["code"] == "timeout"
    assert members["openai/mb"]["ok"] is False and members["openai/mb"]["code"] == "provider_error"
    assert len(members["openai/mb"]["attempts"]) == 3  # the daemon's retry policy applies to members
    assert members["openai/mc"]["ok"] is True
    failed = [c for c in await call_files(daemon, result["run_id"]) if c[-1]["type"] == "error"]
    assert sorted(c[-1]["model"] for c in failed) == ["openai/ma", "openai/mb"]
    assert len(await index_lines(daemon, result["conversation_id"])) == 1


async def test_a_member_and_a_completion_count_on_one_circuit(short_tmp: Path, backend: dict[str, Any]) -> None:
    """Members' failures open the circuit plain completions see, and the other way round: a failing
    server is not asked again by anyone while its circuit is open."""
    async with consortium_daemon(short_tmp, DEFAULT_STUBS, backend, retry_attempts=1, circuit_failures=2,
                                 circuit_reset=60) as (daemon, stubs), connected(daemon) as client:
        await save(client, members=["openai/ma", "openai/mb"])
        stubs["ma"].enqueue(Reply(status=500), Reply(status=500))
        await complete(client, model="consortium/duo", prompt="one")  # ma fails once, mb answers
        with pytest.raises(KsiError) as caught:
            ack = await client.request("completion:async", {"model": "openai/ma", "prompt": "two"})
            await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 30})
        assert caught.value.code == "provider_error"  # the second failure in a row: the circuit opens
        asked = len(stubs["ma"].requests)
        result = await complete(client, model="consortium/duo", prompt="three")
        health = await client.request("system:health")
    members = {e["model"]: e for e in await trace(daemon, result["run_id"]) if e["event"] == "member"}
    assert members["openai/ma"]["ok"] is False and members["openai/ma"]["code"] == "provider_unavailable"
    assert len(stubs["ma"].requests) == asked  # nobody asked the failing server while its circuit was open
    assert health["completions"]["circuits"][f"openai/ma @ {stubs['ma'].api_base}"]["state"] == "open"


async def test_a_member_that_fails_once_is_retried(short_tmp: Path, backend: dict[str, Any]) -> None:
    async with consortium_daemon(short_tmp, DEFAULT_STUBS, backend) as (daemon, stubs), connected(daemon) as client:
        await save(client, members=["openai/ma"])
        stubs["ma"].enqueue(Reply(status=503))
        result = await complete(client, model="consortium/duo", prompt="x")
    member_line = next(e for e in await trace(daemon, result["run_id"]) if e["event"] == "member")
    assert member_line["ok"] is True and [a["ok"] for a in member_line["attempts"]] == [False, True]


async def test_no_member_answering_fails_the_request_without_an_index_line(short_tmp: Path, backend: dict[str, Any]) -> None:
    async with consortium_daemon(short_tmp, DEFAULT_STUBS, backend) as (daemon, stubs), connected(daemon) as client:
        await save(client, members=["openai/ma", "openai/mb"])
        stubs["ma"].enqueue(*[Reply(status=500)] * 3)
        stubs["mb"].enqueue(*[Reply(status=400)])
        ack = await client.request("completion:async", {"model": "consortium/duo", "prompt": "x"})
        with pytest.raises(KsiError) as caught:
            await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 30})
    error = caught.value
    assert error.code == "provider_error"
    assert sorted((f["model"], f["code"]) for f in error.details["failures"]) == [
        ("openai/ma", "provider_error"), ("openai/mb", "provider_error")]
    assert stubs["judge"].requests == []
    assert await index_lines(daemon, ack["conversation_id"]) == []
    assert f"{ack['conversation_id']}.jsonl" not in await stored_under(daemon, "logs/conversations/")
    final = (await trace(daemon, error.details["run_id"]))[-1]
    assert final["event"] == "final" and final["status"] == "failed"
    # the failed request is logged in responses/, as any failed completion is
    [logged] = [n for n in await stored_under(daemon, "logs/responses/") if n.startswith("consortium-duo-")]
    assert (await response_lines(daemon, logged.removesuffix(".jsonl")))[-1]["type"] == "error"


async def test_members_answer_in_parallel(short_tmp: Path, backend: dict[str, Any]) -> None:
    async with consortium_daemon(short_tmp, DEFAULT_STUBS, backend) as (daemon, stubs), connected(daemon) as client:
        await save(client, members=["openai/ma:3"])
        stubs["ma"].hold = 0.3
        await complete(client, model="consortium/duo", prompt="x")
    assert stubs["ma"].max_in_flight == 3


# -- definitions ----------------------------------------------------------------


async def test_save_list_remove_and_restart(short_tmp: Path, backend: dict[str, Any]) -> None:
    async with running_daemon(short_tmp, **backend) as daemon, connected(daemon) as client:
        saved = await save(client, "team", members=["openai/gpt-4o:2", "ollama/qwen3:4b",
                                                      {"model": "bedrock/x-v1:0", "count": 1}],
                           confidence_threshold=80, judging="rank", timeout=30)
        assert saved["model"] == "consortium/team" and saved["replaced"] is False
        again = await save(client, "team", members=["openai/gpt-4o:2", "ollama/qwen3:4b"], confidence_threshold=80)
        assert again["replaced"] is True
    stored = (await stored_items(daemon.settings))["state/consortia/team.json"]
    assert stored["members"] == [{"model": "openai/gpt-4o", "count": 2}, {"model": "ollama/qwen3:4b", "count": 1}]
    assert stored["confidence_threshold"] == 0.8 and stored["judging"] == "synthesis"
    async with running_daemon(short_tmp, **backend) as daemon, connected(daemon) as client:
        listed = await client.request("consortium:list")
        assert [c["name"] for c in listed["consortia"]] == ["team"]
        assert listed["consortia"][0]["arbiter"] == "openai/judge"
        # a saved definition is known after a restart: the ack of a run does not fail
        ack = await client.request("completion:async", {"model": "consortium/team", "prompt": "x"})
        assert ack["status"] == "queued"
        await client.request("completion:cancel", {"request_id": ack["request_id"]})
        assert await client.request("consortium:remove", {"name": "team"}) == {"name": "team", "removed": True}
        assert (await client.request("consortium:list"))["count"] == 0
        with pytest.raises(KsiError) as caught:
            await client.request("completion:async", {"model": "consortium/team", "prompt": "x"})
        assert caught.value.code == "consortium_not_found"


async def test_remove_and_trace_of_unknown_names(client: KsiClient) -> None:
    with pytest.raises(KsiError) as caught:
        await client.request("consortium:remove", {"name": "ghost"})
    assert caught.value.code == "consortium_not_found"
    with pytest.raises(KsiError) as caught:
        await client.request("consortium:trace", {"run_id": "run-0000000000000000"})
    assert caught.value.code == "request_not_found" and caught.value.details["run_id"] == "run-0000000000000000"
    with pytest.raises(KsiError) as caught:
        await client.request("consortium:trace", {"run_id": "../etc"})
    assert caught.value.code == "validation_error" and "run_id" in caught.value.details["fields"]


# -- bad input ------------------------------------------------------------------


async def test_unknown_consortium_fails_the_ack_and_writes_nothing(daemon: Daemon, client: KsiClient) -> None:
    with pytest.raises(KsiError) as caught:
        await client.request("completion:async", {"model": "consortium/nope", "prompt": "x"})
    assert caught.value.code == "consortium_not_found" and caught.value.details["name"] == "nope"
    with pytest.raises(KsiError) as caught:
        await client.request("completion:async", {"model": "consortium/inline", "prompt": "x"})
    assert caught.value.code == "consortium_not_found"
    assert await stored_under(daemon, "logs/conversations/") == set()
    assert await stored_under(daemon, "state/conversations/") == set()
    assert await stored_under(daemon, "logs/responses/") == set()
    assert (await client.request("system:health"))["completions"]["queued"] == 0


@pytest.mark.parametrize(("change", "field"), [
    ({"members": []}, "members"),
    ({"confidence_threshold": 150}, "confidence_threshold"),
    ({"confidence_threshold": -0.1}, "confidence_threshold"),
    ({"min_iterations": 3, "max_iterations": 2}, "max_iterations"),
    ({"members": ["gpt:0"]}, "members.0"),
    ({"members": [""]}, "members.0"),
    ({"members": [":3"]}, "members.0"),
    ({"members": ["openai/a", "openai/b:-2"]}, "members.1"),
    ({"members": ["openai/a b"]}, "members.0"),
    ({"members": ["consortium/other"]}, "members.0"),
    ({"members": [{"model": "openai/a", "count": 0}]}, "members.0.count"),
    ({"members": ["openai/a:20", "openai/b:20"]}, "members"),
    ({"arbiter": ""}, "arbiter"),
    ({"judging": "vote"}, "judging"),
    ({"timeout": 0}, "timeout"),
    ({"name": "../up"}, "name"),
    ({"name": "inline"}, "name"),
    ({"colour": "red"}, "colour"),
])
async def test_bad_definitions_are_refused(daemon: Daemon, client: KsiClient, change: dict[str, Any],
                                           field: str) -> None:
    data = {"name": "bad", "members": ["openai/a"], "arbiter": "openai/judge", **change}
    with pytest.raises(KsiError) as caught:
        await client.request("consortium:save", data)
    assert caught.value.code == "validation_error"
    named = caught.value.details["fields"]
    assert any(name == field or name.startswith(field + ".") for name in named), named
    assert await stored_under(daemon, "state/consortia/") == set()


async def test_bad_inline_definition_fails_the_ack(daemon: Daemon, client: KsiClient) -> None:
    for inline, field in [({"members": [], "arbiter": "openai/j"}, "consortium.members"),
                          ({"members": ["openai/a"], "arbiter": "openai/j", "confidence_threshold": 150},
                           "consortium.confidence_threshold"),
                          ({"members": ["openai/a"]}, "consortium.arbiter")]:
        with pytest.raises(KsiError) as caught:
            await client.request("completion:async", {"consortium": inline, "prompt": "x"})
        assert caught.value.code == "validation_error"
        assert field in caught.value.details["fields"], caught.value.details
    assert await stored_under(daemon, "logs/conversations/") == set()
    assert await stored_under(daemon, "state/conversations/") == set()


# -- streaming, cancelling, health ----------------------------------------------


async def test_a_streamed_consortium_answer_arrives_as_one_chunk(short_tmp: Path, backend: dict[str, Any]) -> None:
    async with consortium_daemon(short_tmp, DEFAULT_STUBS, backend) as (daemon, stubs), connected(daemon) as client:
        await save(client, members=["openai/ma"])
        stubs["judge"].enqueue(verdict(0.9, "streamed whole"))
        await client.request("monitor:subscribe", {"patterns": ["completion:chunk"]})
        result = await complete(client, model="consortium/duo", prompt="x", stream=True)
        push = await client.next_push(timeout=5)
    assert result["content"] == "streamed whole"
    assert push is not None and push["data"]["text"] == "streamed whole"
    assert push["data"]["request_id"] == result["request_id"]
    assert not any(body.get("stream") for body in [*stubs["ma"].requests, *stubs["judge"].requests])


async def test_cancelling_a_run_cancels_its_members(short_tmp: Path, backend: dict[str, Any]) -> None:
    async with consortium_daemon(short_tmp, DEFAULT_STUBS, backend) as (daemon, stubs), connected(daemon) as client:
        await save(client, members=["openai/ma:2"])
        stubs["ma"].hold = 1.0
        ack = await client.request("completion:async", {"model": "consortium/duo", "prompt": "x"})
        for _ in range(200):
            if stubs["ma"].in_flight == 2:
                break
            await asyncio.sleep(0.01)
        cancelled = await client.request("completion:cancel", {"request_id": ack["request_id"]})
        health = await client.request("system:health")
    assert cancelled["cancelled"] is True
    assert health["consortia"]["runs_active"] == 0 and health["consortia"]["runs"] == 1
    run_id = next(n.removesuffix(".jsonl") for n in await stored_under(daemon, "logs/consortium/"))
    final = (await trace(daemon, run_id))[-1]
    assert final["event"] == "final" and final["status"] == "cancelled"
    calls = await call_files(daemon, run_id)
    assert len(calls) == 2 and {c[-1]["code"] for c in calls} == {"cancelled"}
    assert stubs["judge"].requests == []
    assert await index_lines(daemon, ack["conversation_id"]) == []


async def test_the_runs_listing_remembers_only_runs_that_still_have_a_trace(short_tmp: Path) -> None:
    async with consortium_daemon(short_tmp, DEFAULT_STUBS, {}) as (daemon, _stubs), connected(daemon) as client:
        await save(client, "duo")
        first = await complete(client, model="consortium/duo", prompt="One")
        second = await complete(client, model="consortium/duo", prompt="Two")
        assert (await client.request("consortium:runs", {}))["total"] == 2
        (daemon.layout.consortium_dir / f"{first['run_id']}.jsonl").unlink()  # removed by hand
        listed = await client.request("consortium:runs", {})
    assert [run["run_id"] for run in listed["runs"]] == [second["run_id"]]
    assert set(daemon.consortium._ended) == {second["run_id"]}  # the removed run is forgotten
