"""Clients that keep their own history, through the OpenAI door, as their users run them: the
official `openai` SDK resending a growing `messages` list or a Responses `input` list, and the
real `llm` command with an `extra-openai-models.yaml` entry pointing at the daemon's /v1 (not the
KSI plugin). Each ends as ONE KSI conversation."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from ksi_common.jsonl import read_records
from ksi_daemon.context import EventContext
from tests.conftest import PROVIDER_PREFIXES, HttpDaemon
from tests.stub_openai import StubOpenAI

BIN = Path(sys.executable).parent


def sdk(http: HttpDaemon) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{http.base_url}/v1", api_key=http.token, max_retries=0)


async def conversations(http: HttpDaemon) -> dict[str, int]:
    """Every conversation and its number of exchanges."""
    listing = await http.daemon.router.request("conversation:list", {"limit": 1000}, EventContext.root())
    return {c["conversation_id"]: c["exchanges"] for c in listing["conversations"]}


@pytest.fixture
async def client(http_daemon: HttpDaemon) -> AsyncIterator[openai.AsyncOpenAI]:
    async with sdk(http_daemon) as api:
        yield api


async def test_a_growing_messages_list_is_one_conversation(
        http_daemon: HttpDaemon, client: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Short answers."}]
    used = []
    for turn in ("I like tea", "and cake", "what do I like?"):
        messages.append({"role": "user", "content": turn})
        raw = await client.chat.completions.with_raw_response.create(model="openai/stub-model", messages=messages)
        reply = raw.parse()
        used.append(raw.headers.get("x-ksi-history"))
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    assert used == [None, "client", "client"]  # the first turn had no history to send
    assert (reply.model_extra or {})["metadata"] == {"ksi_history": "client"}
    assert list((await conversations(http_daemon)).values()) == [3]
    assert [(m["role"], m["content"]) for m in stub.messages()] == [
        (m["role"], m["content"]) for m in messages[:-1]]
    # with the conversation's id too, the history is checked against it
    conversation_id = raw.headers["x-ksi-conversation-id"]
    await client.chat.completions.create(model="openai/stub-model", messages=[*messages, {"role": "user", "content": "x"}],
                                         extra_body={"conversation_id": conversation_id})
    edited = [messages[0], {"role": "user", "content": "I like coffee"}, *messages[2:]]
    with pytest.raises(openai.ConflictError) as refused:
        await client.chat.completions.create(model="openai/stub-model", messages=[*edited, {"role": "user", "content": "y"}],
                                             extra_body={"conversation_id": conversation_id})
    assert refused.value.code == "history_mismatch"
    assert (refused.value.body or {})["details"]["exchange"] == 1  # type: ignore[index]
    assert list((await conversations(http_daemon)).values()) == [4]


async def test_a_streamed_chat_with_its_history_says_which_history_was_sent(
        http_daemon: HttpDaemon, client: openai.AsyncOpenAI) -> None:
    first = await client.chat.completions.create(model="openai/stub-model", messages=[{"role": "user", "content": "hi"}])
    stream = await client.chat.completions.create(model="openai/stub-model", stream=True, messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "again"}])
    last = None
    async for chunk in stream:
        last = chunk
    assert last is not None and (last.model_extra or {})["metadata"] == {"ksi_history": "client"}
    assert list((await conversations(http_daemon)).values()) == [2]


async def test_a_responses_input_list_with_assistant_items_is_one_conversation(
        http_daemon: HttpDaemon, client: openai.AsyncOpenAI, stub: StubOpenAI) -> None:
    items: list[dict[str, Any]] = []
    for turn in ("My name is Ada", "I live in Oslo", "Who am I?"):
        items.append({"role": "user", "content": turn})
        raw = await client.responses.with_raw_response.create(model="openai/stub-model", input=items,
                                                              instructions="Be brief.")
        reply = raw.parse()
        items.append({"type": "message", "role": "assistant",
                      "content": [{"type": "output_text", "text": reply.output_text}]})
    assert raw.headers["x-ksi-history"] == "client" and reply.metadata == {"ksi_history": "client"}
    assert list((await conversations(http_daemon)).values()) == [3]
    assert [m["role"] for m in stub.messages()] == ["system", "user", "assistant", "user", "assistant", "user"]
    # with previous_response_id the items follow that response, as OpenAI takes them: turns the
    # conversation does not hold there are added after it (see test_http_items_after_point.py)
    await client.responses.create(model="openai/stub-model", previous_response_id=reply.id, input=[
        {"role": "user", "content": "My name is Bob"}, *items[1:], {"role": "user", "content": "and?"}])
    assert list((await conversations(http_daemon)).values()) == [7]


async def test_a_streamed_response_with_its_history_says_so_when_completed(
        http_daemon: HttpDaemon, client: openai.AsyncOpenAI) -> None:
    first = await client.responses.create(model="openai/stub-model", input="hi")
    async with client.responses.stream(model="openai/stub-model", input=[
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "again"}]) as stream:
        async for _event in stream:
            pass
        final = await stream.get_final_response()
    assert final.metadata == {"ksi_history": "client"}
    assert final.conversation is not None and first.conversation is not None
    assert final.conversation.id == first.conversation.id


# -- llm, with an OpenAI-compatible model entry pointing at the daemon -------------------------
def llm_home(root: Path, http: HttpDaemon) -> dict[str, str]:
    home = root / "llm-home"
    home.mkdir(exist_ok=True)
    (home / "extra-openai-models.yaml").write_text(
        f"- model_id: ksi-stub\n  model_name: openai/stub-model\n  api_base: \"{http.base_url}/v1\"\n"
        "  api_key_name: ksi\n")
    (home / "keys.json").write_text(json.dumps({"ksi": http.token}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(PROVIDER_PREFIXES)}
    env.update(LLM_USER_PATH=str(home), PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    return env


async def llm(env: dict[str, str], *args: str) -> str:
    process = await asyncio.create_subprocess_exec(
        str(BIN / "llm"), *args, env=env, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, err.decode()
    return out.decode().strip()


async def test_llm_then_llm_c_twice_is_one_conversation_and_cid_continues_an_older_one(
        http_daemon: HttpDaemon, short_tmp: Path) -> None:
    env = llm_home(short_tmp, http_daemon)
    assert await llm(env, "-m", "ksi-stub", "first question") == "stub answer to: first question"
    await llm(env, "-c", "second question")
    await llm(env, "-c", "third question")
    stored = await conversations(http_daemon)
    assert list(stored.values()) == [3]
    first_ksi = next(iter(stored))
    await llm(env, "-m", "ksi-stub", "--no-stream", "another topic")
    assert sorted((await conversations(http_daemon)).values()) == [1, 3]

    logged = json.loads(await llm(env, "logs", "list", "-n", "0", "--json"))
    older = min(logged, key=lambda r: r["datetime_utc"])["conversation_id"]
    assert await llm(env, "--cid", older, "fourth question") == "stub answer to: fourth question"
    stored = await conversations(http_daemon)
    assert stored[first_ksi] == 4 and sorted(stored.values()) == [1, 4]
    index = read_records(http_daemon.daemon.layout.index_file(first_ksi))
    records = [read_records(http_daemon.daemon.layout.response_file(line["response_id"])) for line in index]
    assert [r[0]["content"] for r in records] == ["first question", "second question", "third question",
                                                   "fourth question"]


async def test_http_bad_history_names_the_clients_field(http_daemon: HttpDaemon) -> None:
    async with httpx.AsyncClient(base_url=http_daemon.base_url,
                                 headers={"Authorization": f"Bearer {http_daemon.token}"}) as http:
        reply = await http.post("/v1/chat/completions", json={"model": "openai/stub-model", "messages": [
            {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "system", "content": "late"}, {"role": "assistant", "content": "c"},
            {"role": "user", "content": "d"}]})
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "validation_error"
    assert reply.json()["error"]["param"].startswith("messages.")
    assert await conversations(http_daemon) == {}
