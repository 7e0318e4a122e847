"""Conversation continuity through a real daemon and real litellm: history at the provider,
restarts, response ids, response files, the index, feedback and legacy index lines."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import orjson
import pytest

from ksi_common.ids import model_slug, new_response_id
from ksi_daemon.daemon import Daemon
from tests.conftest import complete, connected, running_daemon, stub_settings
from tests.stored import stored_index, stored_response

pytestmark = pytest.mark.backends

TS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z$")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


async def index_of(daemon: Daemon, conversation_id: str) -> list[dict[str, Any]]:
    return await stored_index(daemon, conversation_id)


async def response_of(daemon: Daemon, response_id: str) -> list[dict[str, Any]]:
    lines = await stored_response(daemon, response_id)
    assert lines is not None, response_id
    return lines


def chat(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(m["role"], m["content"]) for m in messages]


def without_system(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The conversation turns sent, without the system message."""
    return [(m["role"], m["content"]) for m in messages if m["role"] != "system"]


# -- continuity -------------------------------------------------------------------------------


async def test_history_reaches_the_stub_in_order_and_survives_a_restart(short_tmp: Path, stub: Any,
                                                                          backend: dict[str, Any]) -> None:
    settings = stub_settings(stub, **backend)
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        first = await complete(client, prompt="My name is Alice and I am a dentist",
                               conversation_id="alice", create=True)
        second = await complete(client, prompt="What is my name?", conversation_id="alice")
    assert first["conversation_id"] == second["conversation_id"] == "alice"
    assert chat(stub.messages(0)) == [("user", "My name is Alice and I am a dentist")]
    assert chat(stub.messages(1)) == [
        ("user", "My name is Alice and I am a dentist"),
        ("assistant", first["content"]),
        ("user", "What is my name?"),
    ]
    assert first["content"] == "stub answer to: My name is Alice and I am a dentist"

    # a new daemon on the same var dir knows nothing in memory: it rebuilds from the files
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        third = await complete(client, prompt="And what is my job?", conversation_id="alice")
        other = await complete(client, prompt="Who am I?", conversation_id="bob", create=True)
    assert chat(stub.messages(2)) == [
        ("user", "My name is Alice and I am a dentist"),
        ("assistant", first["content"]),
        ("user", "What is my name?"),
        ("assistant", second["content"]),
        ("user", "And what is my job?"),
    ]
    assert third["history"]["exchanges_total"] == third["history"]["exchanges_sent"] == 2
    # another conversation sees none of it
    assert chat(stub.messages(3)) == [("user", "Who am I?")]
    assert other["conversation_id"] == "bob"
    assert other["history"]["exchanges_total"] == 0
    assert len(stub.requests) == 4


async def test_a_conversation_without_id_gets_a_fresh_one(stub_daemon: Daemon, stub: Any) -> None:
    async with connected(stub_daemon) as client:
        first = await complete(client, prompt="one")
        second = await complete(client, prompt="two")
        third = await complete(client, prompt="three", conversation_id=first["conversation_id"])
    assert first["conversation_id"] != second["conversation_id"]
    assert chat(stub.messages(1)) == [("user", "two")]
    assert chat(stub.messages(2)) == [("user", "one"), ("assistant", first["content"]), ("user", "three")]
    assert third["conversation_id"] == first["conversation_id"]


async def test_echo_model_shows_continuity_in_its_answer(stub_daemon: Daemon) -> None:
    async with connected(stub_daemon) as client:
        first = await complete(client, model="echo/x", prompt="My name is Alice and I am a dentist")
        second = await complete(client, model="echo/x", prompt="What is my name?",
                                conversation_id=first["conversation_id"])
        fresh = await complete(client, model="echo/x", prompt="Who am I?")
    assert "Earlier user inputs: none" in first["content"]
    assert "You said: What is my name?" in second["content"]
    assert "Earlier user inputs: My name is Alice and I am a dentist" in second["content"]
    assert "Messages received: 3" in second["content"]
    assert "Earlier user inputs: none" in fresh["content"]
    assert second["model"] == "echo/x"


async def test_the_conversations_last_model_is_the_default(stub_daemon: Daemon, stub: Any) -> None:
    async with connected(stub_daemon) as client:
        first = await complete(client, model="echo/x", prompt="hello")
        second = await complete(client, prompt="again", conversation_id=first["conversation_id"])
        fresh = await complete(client, prompt="new")
    assert second["model"] == "echo/x"
    assert "Earlier user inputs: hello" in second["content"]
    assert fresh["model"] == "openai/stub-model"  # the setting's default
    assert len(stub.requests) == 1


async def test_switching_models_keeps_the_history(stub_daemon: Daemon, stub: Any) -> None:
    async with connected(stub_daemon) as client:
        first = await complete(client, model="echo/x", prompt="remember 7")
        conversation_id = first["conversation_id"]
        await complete(client, model="openai/stub-a", prompt="what number?", conversation_id=conversation_id)
        third = await complete(client, model="echo/x", prompt="and now?", conversation_id=conversation_id)
    assert chat(stub.messages()) == [("user", "remember 7"), ("assistant", first["content"]),
                                     ("user", "what number?")]
    assert "Earlier user inputs: remember 7 | what number?" in third["content"]


# -- response ids and files --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "slug"),
    [
        ("ollama/qwen3:4b", "ollama-qwen3-4b"),
        ("openai/gpt-4.1-2025-04-14", "openai-gpt-4-1-2025-04-14"),
        ("anthropic/claude-sonnet-4-5", "anthropic-claude-sonnet-4-5"),
        ("openai/stub-4.1:mini", "openai-stub-4-1-mini"),
        ("a//b::c", "a-b-c"),
    ],
)
def test_response_ids_are_model_slugs_with_a_short_hex(model: str, slug: str) -> None:
    assert model_slug(model) == slug
    first, second = new_response_id(model), new_response_id(model)
    assert re.fullmatch(rf"{re.escape(slug)}-[0-9a-f]{{12}}", first)
    assert first != second


def test_long_model_names_are_capped() -> None:
    response_id = new_response_id("x" * 500)
    assert len(response_id) <= 64 + 13
    assert re.fullmatch(r"x+-[0-9a-f]{12}", response_id)


async def test_response_file_and_index_on_disk(stub_daemon: Daemon, stub: Any) -> None:
    model = "openai/stub-4.1:mini"
    async with connected(stub_daemon) as client:
        results = [await complete(client, model=model, prompt="turn one", conversation_id="files", create=True)]
        for prompt in ("turn two", "turn three"):
            results.append(await complete(client, model=model, prompt=prompt, conversation_id="files"))
    assert stub.requests[0]["model"] == "stub-4.1:mini"
    for result in results:
        assert re.fullmatch(r"openai-stub-4-1-mini-[0-9a-f]{12}", result["response_id"])
        assert await stored_response(stub_daemon, result["response_id"]) is not None
    assert len({r["response_id"] for r in results}) == 3

    lines = await response_of(stub_daemon, results[1]["response_id"])
    assert [line["type"] for line in lines] == ["user", "assistant"]
    user, assistant = lines
    assert user["content"] == "turn two"
    assert assistant["content"] == results[1]["content"] == "stub answer to: turn two"
    assert assistant["model"] == model
    assert assistant["finish_reason"] == "stop"
    assert assistant["usage"]["completion_tokens"] > 0
    assert assistant["provider_response_id"].startswith("chatcmpl-")
    for line in lines:
        assert line["v"] == 1
        assert TS.match(line["ts"]), line["ts"]
        assert line["request_id"] == results[1]["request_id"]
        assert line["conversation_id"] == "files"
    # only the raw input is stored, never the expanded prompt with history
    assert "turn one" not in orjson.dumps(lines).decode()

    index = await index_of(stub_daemon, "files")
    assert [line["n"] for line in index] == [1, 2, 3]
    assert [line["response_id"] for line in index] == [r["response_id"] for r in results]
    assert [r["exchange"] for r in results] == [1, 2, 3]
    for line in index:
        assert line["v"] == 1
        assert line["model"] == model
        assert line["provider"] == "openai"
        assert line["tokens_in"] > 0 and line["tokens_out"] > 0
        assert TS.match(line["ts"])
        assert "is_feedback" not in line


async def test_system_prompt_is_kept_in_metadata_and_sent_first(stub_daemon: Daemon, stub: Any) -> None:
    async with connected(stub_daemon) as client:
        first = await complete(client, prompt="hi", system="You are terse.", conversation_id="sys", create=True)
        await complete(client, prompt="again", conversation_id="sys")
        await complete(client, prompt="now", system="You are verbose.", conversation_id="sys")
    assert chat(stub.messages(1)) == [("system", "You are terse."), ("user", "hi"),
                                      ("assistant", first["content"]), ("user", "again")]
    assert stub.messages(2)[0] == {"role": "system", "content": "You are verbose."}
    first_file = await response_of(stub_daemon, first["response_id"])
    assert [line["type"] for line in first_file] == ["system", "user", "assistant"]
    # the system prompt is not history: the index holds only exchange lines
    assert all("system" not in line for line in await index_of(stub_daemon, "sys"))


async def test_a_failed_request_is_logged_but_never_indexed(stub_daemon: Daemon, stub: Any) -> None:
    from tests.stub_openai import Reply

    async with connected(stub_daemon) as client:
        ok = await complete(client, prompt="fine", conversation_id="fails", create=True)
        stub.enqueue(Reply(status=400))
        ack = await client.request("completion:async", {"prompt": "doomed", "conversation_id": "fails"})
        reply = await client.send_frame("completion:wait", {"request_id": ack["request_id"], "timeout": 30})
        status = await client.request("completion:status", {"request_id": ack["request_id"]})
        after = await complete(client, prompt="after", conversation_id="fails")
    assert reply["error"]["code"] == "provider_error"
    assert len(stub.requests) == 3  # a 400 is not retried
    failed_id = status["response_id"]
    lines = await response_of(stub_daemon, failed_id)
    assert [line["type"] for line in lines] == ["user", "error"]
    assert lines[0]["content"] == "doomed"
    assert lines[1]["code"] == "provider_error"
    assert TS.match(lines[1]["ts"])
    index = await index_of(stub_daemon, "fails")
    assert [line["response_id"] for line in index] == [ok["response_id"], after["response_id"]]
    assert [line["n"] for line in index] == [1, 2]
    assert failed_id not in {line["response_id"] for line in index}
    assert chat(stub.messages()) == [("user", "fine"), ("assistant", ok["content"]), ("user", "after")]


# -- legacy index lines ------------------------------------------------------------------------


def write_legacy(var: Path, conversation_id: str, turns: list[tuple[str, str]]) -> list[str]:
    """An index of bare response ids and matching response files, no conversation metadata."""
    responses = var / "logs" / "responses"
    conversations = var / "logs" / "conversations"
    responses.mkdir(parents=True, exist_ok=True)
    conversations.mkdir(parents=True, exist_ok=True)
    ids = []
    for number, (question, answer) in enumerate(turns):
        response_id = f"openai-gpt-4-{number:012x}"
        lines = [
            {"type": "user", "content": question, "ts": "2024-01-01T00:00:00Z"},
            {"type": "assistant", "content": answer, "ts": "2024-01-01T00:00:01Z", "model": "openai/gpt-4"},
        ]
        (responses / f"{response_id}.jsonl").write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
        ids.append(response_id)
    (conversations / f"{conversation_id}.jsonl").write_text("".join(f"{i}\n" for i in ids))
    return ids


@pytest.mark.parametrize("restart", [False, True])
async def test_legacy_bare_id_index_is_read_and_continued(short_tmp: Path, stub: Any, restart: bool) -> None:
    turns = [("I live in Oslo", "Nice city."), ("I have a cat", "Cats are great."), ("Her name is Mia", "Lovely.")]
    ids = write_legacy(short_tmp / "var", "legacy", turns)
    settings = stub_settings(stub)
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        result = await complete(client, prompt="What is my cat called?", conversation_id="legacy")
    expected = []
    for question, answer in turns:
        expected += [("user", question), ("assistant", answer)]
    # (a system message may carry notes about the history, e.g. who answered it)
    assert without_system(stub.messages()) == [*expected, ("user", "What is my cat called?")]
    assert result["exchange"] == 4
    assert result["history"]["exchanges_total"] == 3
    if restart:  # a cold start on a mixed index: legacy lines then a numbered line
        async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
            last = await complete(client, prompt="And where do I live?", conversation_id="legacy")
        assert without_system(stub.messages()) == [*expected, ("user", "What is my cat called?"),
                                         ("assistant", result["content"]), ("user", "And where do I live?")]
        assert last["exchange"] == 5
    raw = (short_tmp / "var" / "logs" / "conversations" / "legacy.jsonl").read_text().splitlines()
    assert raw[:3] == ids  # the legacy lines are left as they were
    numbered = [orjson.loads(line) for line in raw[3:]]
    assert [line["n"] for line in numbered] == ([4, 5] if restart else [4])
    assert numbered[0]["response_id"] == result["response_id"]
    assert numbered[0]["v"] == 1


# -- feedback ----------------------------------------------------------------------------------


@pytest.mark.parametrize("restart", [False, True])
async def test_feedback_is_logged_and_indexed_but_kept_out_of_history(short_tmp: Path, stub: Any, restart: bool,
                                                                      backend: dict[str, Any]) -> None:
    settings = stub_settings(stub, **backend)
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        first = await complete(client, prompt="Tell me a joke", conversation_id="fb", create=True)
        feedback = await complete(client, prompt="That joke was bad", conversation_id="fb", is_feedback=True)
        if not restart:
            await complete(client, prompt="Another one", conversation_id="fb")
    if restart:
        async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
            await complete(client, prompt="Another one", conversation_id="fb")
    # the feedback request itself was sent with the history before it
    assert chat(stub.messages(1)) == [("user", "Tell me a joke"), ("assistant", first["content"]),
                                      ("user", "That joke was bad")]
    # neither the feedback nor its reply is history for later turns
    assert chat(stub.messages(2)) == [("user", "Tell me a joke"), ("assistant", first["content"]),
                                      ("user", "Another one")]
    lines = await response_of(daemon, feedback["response_id"])
    assert [line["type"] for line in lines] == ["feedback", "assistant"]
    assert lines[0]["content"] == "That joke was bad"
    index = await index_of(daemon, "fb")
    assert [line["n"] for line in index] == [1, 2, 3]
    assert index[1]["response_id"] == feedback["response_id"]
    assert index[1]["is_feedback"] is True
    assert "is_feedback" not in index[0] and "is_feedback" not in index[2]


async def test_an_exchange_whose_response_file_is_missing_is_left_out(short_tmp: Path, stub: Any) -> None:
    ids = write_legacy(short_tmp / "var", "holes", [("q1", "a1"), ("q2", "a2"), ("q3", "a3")])
    (short_tmp / "var" / "logs" / "responses" / f"{ids[1]}.jsonl").unlink()
    async with running_daemon(short_tmp, **stub_settings(stub)) as daemon, connected(daemon) as client:
        result = await complete(client, prompt="hi", conversation_id="holes")
    # no lone, empty assistant turn: user and assistant keep alternating
    assert without_system(stub.messages()) == [("user", "q1"), ("assistant", "a1"), ("user", "q3"),
                                               ("assistant", "a3"), ("user", "hi")]
    assert result["exchange"] == 4


# -- streaming ---------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:Item .* is using the `ReadOnly` qualifier:UserWarning")  # litellm types
@pytest.mark.parametrize("model", ["openai/stub-model", "echo/x"])
async def test_a_streamed_answer_is_pushed_in_chunks_and_kept_like_any_other(stub_daemon: Daemon, stub: Any,
                                                                            model: str) -> None:
    async with connected(stub_daemon) as client:
        await client.request("monitor:subscribe", {"patterns": ["completion:chunk", "completion:result"]})
        ack = await client.request("completion:async", {"prompt": "stream this please", "model": model,
                                                        "stream": True, "conversation_id": "st", "create": True})
        chunks = []
        while True:
            push = await client.next_push(timeout=30)
            assert push is not None
            if push["event"] == "completion:result":
                break
            chunks.append(push["data"])
        result = push["data"]
        after = await complete(client, prompt="and again", model=model, conversation_id="st")
    assert len(chunks) > 1
    assert [chunk["index"] for chunk in chunks] == list(range(len(chunks)))
    assert {chunk["request_id"] for chunk in chunks} == {ack["request_id"]}
    assert "".join(chunk["text"] for chunk in chunks) == result["content"]
    assert "stream this please" in result["content"]
    lines = await response_of(stub_daemon, result["response_id"])
    assert [line["type"] for line in lines] == ["user", "assistant"]
    assert lines[1]["content"] == result["content"]
    assert [line["response_id"] for line in await index_of(stub_daemon, "st")] == [result["response_id"],
                                                                             after["response_id"]]
    if model.startswith("openai/"):
        assert stub.requests[0]["stream"] is True
        assert chat(stub.messages()) == [("user", "stream this please"), ("assistant", result["content"]),
                                         ("user", "and again")]
    else:
        assert "Earlier user inputs: stream this please" in after["content"]


async def test_continuity_survives_eviction_from_memory(short_tmp: Path, stub: Any, backend: dict[str, Any]) -> None:
    settings = stub_settings(stub, active_conversations=2, **backend)  # at most two conversations in memory
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        for turn in range(3):
            for name in ("a", "b", "c"):
                # create: true on an existing conversation simply continues it
                await complete(client, prompt=f"{name}{turn}", conversation_id=name, create=True)
        assert daemon.completion.health()["conversations_in_memory"] <= 2
    for name in ("a", "b", "c"):
        body = [request for request in stub.requests if request["messages"][-1]["content"] == f"{name}2"][0]
        assert [m["content"] for m in body["messages"] if m["role"] == "user"] == [f"{name}0", f"{name}1", f"{name}2"]
        index = await index_of(daemon, name)
        assert [line["n"] for line in index] == [1, 2, 3]


async def test_unsynced_writes_keep_continuity_and_the_journal(short_tmp: Path) -> None:
    """With fsync never the exchange is written on the loop: same files, same history."""
    async with running_daemon(short_tmp, fsync="never") as daemon, connected(daemon) as client:
        first = await complete(client, model="echo/x", prompt="My name is Alice")
        second = await complete(client, conversation_id=first["conversation_id"], prompt="What is my name?")
    assert "Earlier user inputs: My name is Alice" in second["content"]
    async with running_daemon(short_tmp, fsync="never") as daemon, connected(daemon) as client:
        third = await complete(client, conversation_id=first["conversation_id"], prompt="Still there?")
        status = await client.request("completion:status", {"request_id": third["request_id"]})
    assert "Earlier user inputs: My name is Alice | What is my name?" in third["content"]
    assert status["status"] == "done"
    index = (short_tmp / "var/logs/conversations" / f"{first['conversation_id']}.jsonl").read_bytes().splitlines()
    assert [orjson.loads(line)["n"] for line in index] == [1, 2, 3]
    journal = [orjson.loads(line) for line in (short_tmp / "var/state/requests.jsonl").read_bytes().splitlines()]
    lines = [line for line in journal if line["request_id"] == third["request_id"]]
    assert [line["status"] for line in lines] == ["queued", "done"]
    assert lines[0]["response_id"] == third["response_id"]  # known from the ack: a restart can find it indexed
