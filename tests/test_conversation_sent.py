"""`conversation:sent`: what the model was sent for one exchange, rebuilt from the files, equals
what the (stub) provider received: system with notes, history shown, new input."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest

from ksi_common.errors import KsiError
from ksi_daemon.services.completion.compaction import SUMMARISER_SYSTEM
from tests.conftest import complete, connected, running_daemon, stub_settings
from tests.stub_openai import StubOpenAI, default_answer

SMALL = "openai/stub-small"


def as_sent(reply: dict[str, Any]) -> list[dict[str, str]]:
    return [{"role": m["role"], "content": m["content"]} for m in reply["messages"]]


def received(stub: Any, prompt: str) -> list[dict[str, Any]]:
    """What the stub received for the turn whose new input was `prompt` (a background summary
    request may have come after it)."""
    return next(r["messages"] for r in reversed(stub.requests) if r["messages"][-1]["content"] == prompt)


async def test_sent_matches_what_the_provider_received(short_tmp: Path, stub: Any) -> None:
    async with running_daemon(short_tmp, **stub_settings(stub)) as daemon, connected(daemon) as client:
        await complete(client, prompt="first question", conversation_id="talk", create=True, system="be brief")
        await complete(client, prompt="second question", conversation_id="talk")
        shown = await client.request("conversation:sent", {"conversation_id": "talk", "n": 2})
        assert as_sent(shown) == stub.messages(-1)
        assert shown["recorded"] is True and shown["history"] == [1] and shown["omitted"] == 0
        assert [m["part"] for m in shown["messages"]] == ["system", "history", "history", "input"]

        fork = await client.request("conversation:fork", {"conversation_id": "talk", "at": 1, "new_id": "branch"})
        assert fork["fork_at"] == 1
        await complete(client, prompt="other second", conversation_id="branch")
        shown = await client.request("conversation:sent", {"conversation_id": "branch", "n": 2})
        assert as_sent(shown) == stub.messages(-1)
        assert "second question" not in str(shown["messages"])
        first = await client.request("conversation:sent", {"conversation_id": "branch", "n": 1})
        assert as_sent(first) == stub.messages(0)

        # another model answers turn 3: the system note naming the answerers is rebuilt too
        await complete(client, prompt="third question", conversation_id="talk", model="openai/stub-other")
        await complete(client, prompt="fourth question", conversation_id="talk")
        shown = await client.request("conversation:sent", {"conversation_id": "talk", "n": 4})
        assert "earlier replies came from" in shown["messages"][0]["content"]
        assert as_sent(shown) == stub.messages(-1)

        # instructions replace the system prompt for one request only
        await complete(client, prompt="fifth question", conversation_id="talk", instructions="answer in French")
        shown = await client.request("conversation:sent", {"conversation_id": "talk", "n": 5})
        assert shown["messages"][0]["content"].startswith("answer in French")
        assert as_sent(shown) == stub.messages(-1)

        with pytest.raises(KsiError) as caught:
            await client.request("conversation:sent", {"conversation_id": "talk", "n": 6})
        assert caught.value.code == "validation_error"
        with pytest.raises(KsiError) as caught:
            await client.request("conversation:sent", {"conversation_id": "nobody", "n": 1})
        assert caught.value.code == "conversation_not_found"


def short_summaries(messages: list[dict[str, Any]]) -> str:
    if str(messages[0].get("content")).startswith(SUMMARISER_SYSTEM[:40]):
        turns = re.findall(r"\] User: turn (\d+)", str(messages[-1]["content"]))
        return f"the user counted turns {', '.join(turns)}"
    return default_answer(messages)


async def test_sent_names_exchanges_left_out_by_the_budget_and_the_summary(short_tmp: Path) -> None:
    async with StubOpenAI(answer=short_summaries) as stub:
        await sent_with_a_small_window(short_tmp, stub)


async def sent_with_a_small_window(short_tmp: Path, stub: StubOpenAI) -> None:
    models = {SMALL: {"api_base": stub.api_base, "context_window": 400, "output_reserve": 50}}
    async with running_daemon(short_tmp, **stub_settings(stub, models=models)) as daemon, connected(daemon) as client:
        prompts = [f"turn {turn} " + "words " * 40 for turn in range(6)]
        for prompt in prompts[:5]:
            await complete(client, prompt=prompt, conversation_id="long", create=True, model=SMALL)
        # the background summary of the left-out exchanges is ready before the last turn
        for _ in range(200):
            if daemon.layout.summaries_file("long").exists():
                break
            await asyncio.sleep(0.05)
        await complete(client, prompt=prompts[5], conversation_id="long", model=SMALL)
        for n in range(2, 7):
            shown = await client.request("conversation:sent", {"conversation_id": "long", "n": n})
            assert as_sent(shown) == received(stub, prompts[n - 1])
            assert shown["omitted"] > 0 or shown["stand_in"] or shown["history"] == list(range(1, n))
        assert 1 not in shown["history"] and shown["stand_in"][0]["first"] == 1
        assert re.match(r"\[(Summary of e|E)xchanges 1\b", shown["messages"][0]["content"])
