"""Token-budgeted history: oldest exchanges dropped first, whole exchanges only, a note in the
system message, and inputs that cannot fit refused before any provider call."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import orjson
import pytest

from ksi_common.errors import KsiError
from ksi_daemon.daemon import Daemon
from ksi_daemon.services.conversations.history import MESSAGE_OVERHEAD, NOTE_RESERVE
from tests.conftest import complete, connected, running_daemon, stub_settings
from tests.stub_openai import Reply

RESERVE = 50
WINDOW = 250 + NOTE_RESERVE  # about 200 tokens for history and input, whatever the notes reserve
SMALL = "openai/stub-small"


def small_window(stub: Any, **overrides: Any) -> dict[str, Any]:
    """The budget arithmetic alone: no summary and no learned ratio (compaction off behaves as
    before compaction existed; tests/test_compaction.py and test_calibration.py cover those)."""
    models = {SMALL: {"api_base": stub.api_base, "context_window": WINDOW, "output_reserve": RESERVE}}
    return stub_settings(stub, models=models, summariser="off", calibration=False, **overrides)


@pytest.fixture
async def stub_daemon_small(short_tmp: Path, stub: Any) -> Any:
    async with running_daemon(short_tmp, **small_window(stub)) as daemon:
        yield daemon


def index_of(daemon: Daemon, conversation_id: str) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in daemon.layout.index_file(conversation_id).read_bytes().splitlines()]


def expected_kept(index: list[dict[str, Any]], budget: int) -> int:
    """How many of the newest exchanges fit `budget`, whole, newest first."""
    kept, spent = 0, 0
    for line in reversed(index):
        cost = line["tokens_in"] + line["tokens_out"]
        if spent + cost > budget:
            break
        spent += cost
        kept += 1
    return kept


def tokens(text: str) -> int:
    """Tokens of `text` as the daemon counts them (litellm's bundled cl100k)."""
    from litellm.litellm_core_utils.default_encoding import encoding

    return len(encoding.encode(text, disallowed_special=()))


def prompt_of_tokens(cost: int) -> str:
    """A prompt whose input costs about `cost` tokens, message overhead included."""
    words = ["tell me about"]
    while tokens(" ".join(words)) + MESSAGE_OVERHEAD < cost:
        words.append(f"topic{len(words)}")
    return " ".join(words)


def history_pairs(prompts: list[str], results: list[dict[str, Any]]) -> list[tuple[str, str]]:
    pairs = []
    for prompt, result in zip(prompts, results, strict=True):
        pairs += [("user", prompt), ("assistant", result["content"])]
    return pairs


def chat(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(m["role"], m["content"]) for m in messages]


NOTE = re.compile(r"\[Note: (\d+) earlier exchanges? (was|were) left out of this conversation's history")


@pytest.mark.parametrize("system", [None, "You are a careful assistant."])
async def test_oldest_exchanges_are_dropped_first_and_a_note_says_how_many(stub_daemon_small: Any, stub: Any,
                                                                           system: str | None) -> None:
    daemon: Daemon = stub_daemon_small
    prompts = [f"fact {i}: the sky over the harbour was grey and the boats stayed in port" for i in range(8)]
    results = []
    async with connected(daemon) as client:
        extra = {"system": system} if system else {}
        results.append(await complete(client, model=SMALL, prompt=prompts[0], conversation_id="budget",
                                      create=True, **extra))
        for prompt in prompts[1:]:
            results.append(await complete(client, model=SMALL, prompt=prompt, conversation_id="budget"))
        last = await complete(client, model=SMALL, prompt="What was fact 0?", conversation_id="budget")

    index = index_of(daemon, "budget")
    assert len(index) == 9
    sent = last["history"]
    assert sent["exchanges_total"] == 8
    assert 0 < sent["exchanges_sent"] < 8
    kept = sent["exchanges_sent"]
    system_tokens = tokens(system) + MESSAGE_OVERHEAD if system else 0  # the system prompt takes its share
    budget = WINDOW - RESERVE - NOTE_RESERVE - system_tokens - index[-1]["tokens_in"]
    assert kept == expected_kept(index[:8], budget)
    # the newest exchanges are kept whole and in order, the oldest dropped
    assert sent["tokens_sent"] == sum(line["tokens_in"] + line["tokens_out"] for line in index[8 - kept:8])
    messages = stub.messages()
    assert messages[0]["role"] == "system"
    note = NOTE.search(messages[0]["content"])
    assert note is not None and int(note.group(1)) == 8 - kept
    if system:
        assert messages[0]["content"].startswith(system + "\n\n[Note:")
    else:
        assert messages[0]["content"].startswith("[Note:")
    assert chat(messages[1:]) == [*history_pairs(prompts[8 - kept:], results[8 - kept:]),
                                  ("user", "What was fact 0?")]
    assert "fact 0:" not in orjson.dumps(messages).decode()


async def test_nothing_is_omitted_while_everything_fits(stub_daemon_small: Daemon, stub: Any) -> None:
    async with connected(stub_daemon_small) as client:
        first = await complete(client, model=SMALL, prompt="hi", conversation_id="fits", create=True)
        last = await complete(client, model=SMALL, prompt="again", conversation_id="fits")
    sent = {key: last["history"][key] for key in ("exchanges_total", "exchanges_sent", "exchanges_omitted")}
    assert sent == {"exchanges_total": 1, "exchanges_sent": 1, "exchanges_omitted": 0}
    assert last["history"]["tokens_sent"] > 0
    assert chat(stub.messages()) == [("user", "hi"), ("assistant", first["content"]), ("user", "again")]


async def test_an_exchange_that_does_not_fit_is_dropped_whole_with_everything_older(stub_daemon_small: Daemon,
                                                                                    stub: Any) -> None:
    big = prompt_of_tokens(170)  # fits alone (about 200 are free), not with the two newest exchanges
    prompts = ["small one", big, "small two", "small three"]
    results = []
    async with connected(stub_daemon_small) as client:
        for number, prompt in enumerate(prompts):
            stub.enqueue(Reply(text=f"ok {number}"))
            results.append(await complete(client, model=SMALL, prompt=prompt, conversation_id="big",
                                          create=number == 0))
        last = await complete(client, model=SMALL, prompt="and now?", conversation_id="big")
    index = index_of(stub_daemon_small, "big")
    budget = WINDOW - RESERVE - NOTE_RESERVE - index[-1]["tokens_in"]
    cost = [line["tokens_in"] + line["tokens_out"] for line in index]
    assert cost[1] > budget - cost[2] - cost[3]  # the big exchange no longer fits...
    assert cost[0] <= budget - cost[2] - cost[3]  # ...but the oldest, small one would
    # the big exchange alone was sent while it fitted
    assert chat(stub.messages(1))[-1] == ("user", big)
    assert last["history"]["exchanges_total"] == 4
    assert last["history"]["exchanges_sent"] == 2
    messages = stub.messages()
    assert NOTE.search(messages[0]["content"]).group(1) == "2"  # type: ignore[union-attr]
    # "small one" would fit the leftover budget, but history is a contiguous newest tail
    assert chat(messages[1:]) == [("user", "small two"), ("assistant", "ok 2"), ("user", "small three"),
                                  ("assistant", "ok 3"), ("user", "and now?")]
    assert "topic1" not in orjson.dumps(messages).decode()


async def test_the_budget_after_a_restart_reads_only_the_tail(short_tmp: Path, stub: Any) -> None:
    settings = small_window(stub)
    prompts = [f"note {i}: remember the number {i * 7} and the colour of the door" for i in range(8)]
    results = []
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        for number, prompt in enumerate(prompts):
            results.append(await complete(client, model=SMALL, prompt=prompt, conversation_id="cold",
                                          create=number == 0))
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        last = await complete(client, model=SMALL, prompt="Which numbers?", conversation_id="cold")
        index = index_of(daemon, "cold")
    budget = WINDOW - RESERVE - NOTE_RESERVE - index[-1]["tokens_in"]
    kept = expected_kept(index[:8], budget)
    assert 0 < kept < 8
    assert last["history"]["exchanges_total"] == 8
    assert last["history"]["exchanges_sent"] == kept
    messages = stub.messages()
    assert NOTE.search(messages[0]["content"]).group(1) == str(8 - kept)  # type: ignore[union-attr]
    assert chat(messages[1:]) == [*history_pairs(prompts[8 - kept:], results[8 - kept:]), ("user", "Which numbers?")]


async def test_feedback_costs_no_budget(stub_daemon_small: Daemon, stub: Any) -> None:
    async with connected(stub_daemon_small) as client:
        first = await complete(client, model=SMALL, prompt="keep me", conversation_id="fbb", create=True)
        for i in range(6):
            await complete(client, model=SMALL, is_feedback=True, conversation_id="fbb",
                           prompt=f"feedback {i}: " + "this answer was not good enough " * 4)
        last = await complete(client, model=SMALL, prompt="still there?", conversation_id="fbb")
    assert last["history"]["exchanges_total"] == last["history"]["exchanges_sent"] == 1
    assert chat(stub.messages()) == [("user", "keep me"), ("assistant", first["content"]), ("user", "still there?")]


async def test_an_input_that_alone_exceeds_the_window_fails_before_any_call(stub_daemon_small: Daemon,
                                                                           stub: Any) -> None:
    async with connected(stub_daemon_small) as client:
        await complete(client, model=SMALL, prompt="hello", conversation_id="huge", create=True)
        ack = await client.request("completion:async", {"model": SMALL, "conversation_id": "huge",
                                                        "prompt": "word " * 400})
        with pytest.raises(KsiError) as caught:
            await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 30})
        status = await client.request("completion:status", {"request_id": ack["request_id"]})
    assert caught.value.code == "context_window_exceeded"
    assert caught.value.details["context_window"] == WINDOW
    assert caught.value.details["input_tokens"] > WINDOW
    assert 0 < tokens_over(caught.value) < caught.value.details["input_tokens"]
    assert len(stub.requests) == 1
    assert status["status"] == "failed" and status["reason"] == "context_window_exceeded"
    assert len(index_of(stub_daemon_small, "huge")) == 1
    lines = [orjson.loads(line) for line in
             stub_daemon_small.layout.response_file(status["response_id"]).read_bytes().splitlines()]
    assert [line["type"] for line in lines] == ["user", "error"]
    assert lines[1]["code"] == "context_window_exceeded"


async def test_a_system_prompt_that_alone_exceeds_the_window_says_by_how_much(stub_daemon_small: Daemon,
                                                                              stub: Any) -> None:
    async with connected(stub_daemon_small) as client:
        with pytest.raises(KsiError) as caught:
            await complete(client, model=SMALL, prompt="hi", system="word " * 400)
    assert caught.value.code == "context_window_exceeded"
    assert tokens_over(caught.value) >= 400 - (WINDOW - RESERVE)  # the system prompt's excess, not a negative room
    assert stub.requests == []


def tokens_over(error: KsiError) -> int:
    """The excess the message names: "needs about N tokens more"."""
    found = re.search(r"needs about (-?\d+) tokens more", str(error))
    assert found, str(error)
    return int(found.group(1))


async def test_a_large_max_tokens_leaves_no_room_for_the_input(stub_daemon_small: Daemon, stub: Any) -> None:
    async with connected(stub_daemon_small) as client:
        with pytest.raises(KsiError) as caught:
            await complete(client, model=SMALL, prompt="a short question", max_tokens=WINDOW)
    assert caught.value.code == "context_window_exceeded"
    assert caught.value.details["output_reserve"] == WINDOW
    assert stub.requests == []


async def test_an_error_event_is_pushed_for_context_window_exceeded(stub_daemon_small: Daemon, stub: Any) -> None:
    async with connected(stub_daemon_small) as client:
        await client.request("monitor:subscribe", {"patterns": ["completion:*"]})
        ack = await client.request("completion:async", {"model": SMALL, "prompt": "word " * 400})
        push = None
        while push is None or push["event"] == "completion:async":
            push = await client.next_push(timeout=30)
            assert push is not None
    assert push["event"] == "completion:error"
    assert push["data"]["code"] == "context_window_exceeded"
    assert push["data"]["request_id"] == ack["request_id"]
    assert push["data"]["conversation_id"] == ack["conversation_id"]
    assert stub.requests == []


async def test_legacy_index_lines_are_budgeted_too(short_tmp: Path, stub: Any) -> None:
    from tests.test_completion_continuity import write_legacy

    turns = [(f"question {i}: " + "tell me more about the weather " * 8, f"answer {i}: " + "it rains " * 10)
             for i in range(10)]
    write_legacy(short_tmp / "var", "old", turns)
    async with running_daemon(short_tmp, **small_window(stub)) as daemon, connected(daemon) as client:
        last = await complete(client, model=SMALL, prompt="summarise", conversation_id="old")
    sent = last["history"]
    assert sent["exchanges_total"] == 10
    assert 0 < sent["exchanges_sent"] < 10
    kept = sent["exchanges_sent"]
    cost = [tokens(q) + tokens(a) + 2 * MESSAGE_OVERHEAD for q, a in turns]
    budget = WINDOW - RESERVE - NOTE_RESERVE - (tokens("summarise") + MESSAGE_OVERHEAD)
    assert sum(cost[10 - kept:]) <= budget < sum(cost[9 - kept:])
    assert sent["tokens_sent"] == sum(cost[10 - kept:])
    messages = stub.messages()
    assert NOTE.search(messages[0]["content"]).group(1) == str(10 - kept)  # type: ignore[union-attr]
    expected = []
    for question, answer in turns[10 - kept:]:
        expected += [("user", question), ("assistant", answer)]
    assert [(m["role"], m["content"]) for m in messages if m["role"] != "system"] == [*expected, ("user", "summarise")]
    assert last["exchange"] == 11
