"""A fork reuses its parent's cached prefix: a fork at exchange k sends, up to its new input, the
same bytes as the parent's turn k+1 did (system prompt, stored stand-ins, the window's start, the
breakpoints), under the parent's OpenAI cache key and in its llama.cpp slot, so the provider reads
it from its cache. Against the cache emulator over HTTP, real daemon, both storage backends."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.cache_emulator import MINIMUM, CacheEmulator, anthropic_blocks, prompt_words, shared_prefix
from tests.conftest import complete, connected, running_daemon
from tests.test_compaction import FILLER, settled

pytestmark = pytest.mark.backends

SYSTEM = " ".join(["the"] * (MINIMUM + 100))
WRITER = "openai/cache-writer"
MODELS = {"openai": "openai/cache-model", "anthropic": "anthropic/cache-model"}
TURNS = 10


def settings_for(emulator: CacheEmulator, backend: dict[str, Any], shape: str) -> dict[str, Any]:
    """A window of a few exchanges, so stored stand-ins take over the oldest ones."""
    where = ({"api_base": emulator.api_base} if shape == "openai" else
             {"api_base": emulator.api_base.removesuffix("/v1"), "api_key_env": "CACHE_EMULATOR_KEY"})
    models = {MODELS[shape]: {**where, "context_window": MINIMUM + 2400, "output_reserve": 100},
              WRITER: {"api_base": emulator.api_base}}
    return {"models": models, "default_model": MODELS[shape], "summariser": WRITER, "calibration": False,
            **backend}


def turns_sent(emulator: CacheEmulator, shape: str) -> list[tuple[dict[str, Any], int]]:
    """Each turn's request (not the summariser's) with the tokens the emulator read from its cache."""
    if shape == "openai":
        return [(body, usage["prompt_tokens_details"]["cached_tokens"])
                for body, usage in zip(emulator.requests, emulator.usages, strict=True)
                if body.get("model") != WRITER.removeprefix("openai/")]
    return [(body, usage["cache_read_input_tokens"])
            for body, usage in zip(emulator.anthropic_requests, emulator.anthropic_usages, strict=True)]


def before_input(body: dict[str, Any]) -> bytes:
    """The request's bytes up to its new input: all but its last message (the new input's own
    breakpoint goes with it), its tools and system, and the OpenAI cache key."""
    prefix = {key: value for key, value in body.items() if key in ("system", "tools", "prompt_cache_key")}
    return orjson.dumps({**prefix, "messages": body["messages"][:-1]}, option=orjson.OPT_SORT_KEYS)


def prefix_words(body: dict[str, Any], shape: str) -> list[str]:
    if shape == "openai":
        return prompt_words(body)
    return [word for text, _tokens, _life in anthropic_blocks(body) for word in text.split()]


@pytest.mark.parametrize("shape", ["openai", "anthropic"])
async def test_a_forks_first_request_opens_as_its_parents_next_turn_did_and_reads_it_from_the_cache(
        short_tmp: Path, backend: dict[str, Any], shape: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHE_EMULATOR_KEY", "sk-ant-local")
    model = MODELS[shape]
    async with CacheEmulator() as emulator:
        async with running_daemon(short_tmp, **settings_for(emulator, backend, shape)) as daemon:
            async with connected(daemon) as client:
                for turn in range(TURNS):
                    await complete(client, prompt=f"turn {turn} {FILLER * 3}", conversation_id="p",
                                   create=turn == 0, system=SYSTEM, model=model)
                    await settled(daemon)  # its stand-in is stored before the next turn, as the parent's was
                # a fork at every exchange the parent went on from: each first request meets the cache
                # the parent's turn k+1 filled (stand-ins the parent stored later are not the fork's)
                for k in range(1, TURNS):
                    await client.request("conversation:fork", {"conversation_id": "p", "at": k, "new_id": f"f{k}"})
                    await complete(client, prompt=f"another turn {FILLER * 3}", conversation_id=f"f{k}", model=model)
                    await settled(daemon)
    sent = turns_sent(emulator, shape)
    parent, forks = sent[:TURNS], sent[TURNS:]
    assert any(len(body.get("system") or []) > 1 or "Exchanges 1-" in str(body["messages"][0]["content"])
               for body, _read in parent), "no stored stand-in took over the oldest exchanges"
    for k, ((fork, read), (next_turn, _read)) in enumerate(zip(forks, parent[1:], strict=True), start=1):
        assert before_input(fork) == before_input(next_turn), f"the fork at {k} opened differently"
        assert fork["messages"][-1] != next_turn["messages"][-1]  # only the new input differs
        cacheable = shared_prefix(prefix_words(next_turn, shape), prefix_words(fork, shape))
        assert cacheable >= MINIMUM and read >= 0.8 * cacheable, f"the fork at {k} read {read} of {cacheable}"
    if shape == "openai":
        assert {body["prompt_cache_key"] for body, _read in sent} == {"ksi:p"}


async def test_a_fork_of_a_fork_sends_its_roots_cache_key_and_slot_and_a_clients_own_key_is_kept(
        short_tmp: Path, backend: dict[str, Any]) -> None:
    keyed, slotted = "openai/cache-keyed", "openai/cache-local"
    async with CacheEmulator() as emulator:
        models = {keyed: {"api_base": emulator.api_base}, slotted: {"api_base": emulator.api_base, "cache_slots": 64}}
        async with running_daemon(short_tmp, models=models, default_model=keyed, summariser="off",
                                  **backend) as daemon:
            async with connected(daemon) as client:
                for model, root in ((keyed, "k"), (slotted, "s")):
                    await complete(client, prompt="one", conversation_id=root, create=True, model=model)
                    await complete(client, prompt="two", conversation_id=root, model=model)
                    await client.request("conversation:fork", {"conversation_id": root, "at": 1,
                                                               "new_id": f"{root}1"})
                    await complete(client, prompt="branch", conversation_id=f"{root}1", model=model)
                    await client.request("conversation:fork", {"conversation_id": f"{root}1", "at": 2,
                                                               "new_id": f"{root}2"})
                    await complete(client, prompt="twig", conversation_id=f"{root}2", model=model)
                await complete(client, prompt="mine", conversation_id="k2", model=keyed,
                               options={"prompt_cache_key": "client-key"})
                await client.request("conversation:delete", {"conversation_id": "s"})
                await complete(client, prompt="orphan", conversation_id="s1", model=slotted)
    keyed_bodies, slotted_bodies, mine, orphan = emulator.requests[:4], emulator.requests[4:8], *emulator.requests[8:]
    assert [body["prompt_cache_key"] for body in keyed_bodies] == ["ksi:k"] * 4
    assert len({body["id_slot"] for body in slotted_bodies}) == 1  # the root's slot, which holds the shared prefix
    assert mine["prompt_cache_key"] == "client-key"
    # a fork whose parent is gone shares nothing with it any more: it is its own root
    assert [m["content"] for m in orphan["messages"]] == ["branch", "answer 7", "orphan"]
    assert orphan["id_slot"] == slot_of("s1", 64) != slot_of("s", 64) == slotted_bodies[0]["id_slot"]


def slot_of(conversation_id: str, slots: int) -> int:
    """The slot the docs give a conversation: a digest of its id modulo the slot count."""
    return int.from_bytes(hashlib.sha256(conversation_id.encode()).digest()[:8], "big") % slots
