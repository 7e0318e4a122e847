"""Where KSI's cache markers go, seen at a provider emulator over HTTP (real daemon requests through
litellm, the placement never mocked): Anthropic breakpoints on the system prompt, the newest stored
summary and the newest message, with the per-model lifetime; a llama.cpp-style server's slot
options. Both storage backends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.cache_emulator import MAX_BREAKPOINTS, MINIMUM, CacheEmulator, anthropic_blocks
from tests.conftest import complete, connected, running_daemon
from tests.test_compaction import FILLER, settled

pytestmark = pytest.mark.backends

SYSTEM = " ".join(["the"] * (MINIMUM + 100))  # one cl100k token a word: cacheable, yet small beside the window
ANTHROPIC = "anthropic/cache-model"
SMALL = "anthropic/cache-small"
WRITER = "openai/cache-writer"


@pytest.fixture
def emulator_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHE_EMULATOR_KEY", "sk-ant-local")


def anthropic_settings(emulator: CacheEmulator, backend: dict[str, Any], **models: dict[str, Any]) -> dict[str, Any]:
    where = {"api_base": emulator.api_base.removesuffix("/v1"), "api_key_env": "CACHE_EMULATOR_KEY"}
    return {"models": {name: {**where, **extra} for name, extra in models.items()}
            | {WRITER: {"api_base": emulator.api_base}},
            "default_model": ANTHROPIC, "summariser": "off", "calibration": False, **backend}


def markers(body: dict[str, Any]) -> list[tuple[str, str]]:
    """Each breakpoint of a Messages request in prompt order: where it is and its lifetime."""
    found = [("system", b["cache_control"].get("ttl", "5m")) for b in body.get("system") or [] if "cache_control" in b]
    for message in body["messages"]:
        content = message["content"]
        found += [(message["role"], b["cache_control"].get("ttl", "5m"))
                  for b in (content if isinstance(content, list) else []) if "cache_control" in b]
    return found


async def test_the_newest_stored_summary_gets_its_own_breakpoint_and_the_next_turn_reads_through_it(
        short_tmp: Path, backend: dict[str, Any], emulator_key: None) -> None:
    async with CacheEmulator() as emulator:
        settings = anthropic_settings(emulator, backend, **{SMALL: {"context_window": MINIMUM + 2400,
                                                                    "output_reserve": 100}})
        settings.update(summariser=WRITER, default_model=SMALL)
        async with running_daemon(short_tmp, **settings) as daemon:
            async with connected(daemon) as client:
                for turn in range(12):
                    await complete(client, prompt=f"turn {turn} {FILLER * 3}", conversation_id="s",
                                   create=turn == 0, system=SYSTEM, model=SMALL)
                    await settled(daemon)
    summarised = [(n, body) for n, body in enumerate(emulator.anthropic_requests) if len(body["system"]) > 1]
    assert len(summarised) >= 2, "the window never left exchanges out"
    for n, body in summarised:
        system = body["system"]
        assert system[0]["text"] == SYSTEM and system[0]["cache_control"] == {"type": "ephemeral"}
        assert system[1]["text"].lstrip().startswith(("[Summary of exchanges", "[Exchanges"))
        assert "cache_control" in system[1]
        assert len(markers(body)) <= MAX_BREAKPOINTS and markers(body)[-1][0] == "user"
    # a turn under the same summary as the turn before reads at least the system prompt and the summary
    same = [later_n for (_n, earlier), (later_n, later) in zip(summarised, summarised[1:], strict=False)
            if earlier["system"][1]["text"] == later["system"][1]["text"]]
    assert same, "no two turns in a row were sent the same summary"
    for n in same:
        through_summary = sum(tokens for _t, tokens, _life in anthropic_blocks(emulator.anthropic_requests[n])[:2])
        assert emulator.anthropic_usages[n]["cache_read_input_tokens"] >= through_summary


async def test_the_model_lifetime_setting_keeps_the_system_prompt_cached_through_a_pause(
        short_tmp: Path, backend: dict[str, Any], emulator_key: None) -> None:
    hour, default = "anthropic/cache-hour", "anthropic/cache-default"
    async with CacheEmulator() as emulator:
        settings = anthropic_settings(emulator, backend, **{hour: {"cache_ttl": "1h"}, default: {}})
        async with running_daemon(short_tmp, **settings) as daemon:
            async with connected(daemon) as client:
                for model, conversation in ((hour, "h"), (default, "d")):
                    await complete(client, prompt="first", conversation_id=conversation, create=True,
                                   system=SYSTEM + conversation, model=model)
                emulator.skew += 600  # ten minutes pass: past the default five, within the hour
                for model, conversation in ((hour, "h"), (default, "d")):
                    await complete(client, prompt="second", conversation_id=conversation, model=model)
    first_hour, first_default, second_hour, second_default = emulator.anthropic_requests
    assert markers(first_hour) == [("system", "1h"), ("user", "5m")]  # longer lifetimes first
    assert markers(first_default) == [("system", "5m"), ("user", "5m")]
    reads = [usage["cache_read_input_tokens"] for usage in emulator.anthropic_usages]
    assert reads[2] >= MINIMUM and reads[3] == 0
    assert markers(second_hour) == [("system", "1h"), ("assistant", "5m"), ("user", "5m")]


async def test_a_local_server_with_slots_gets_cache_prompt_and_one_stable_slot_per_conversation(
        short_tmp: Path, backend: dict[str, Any]) -> None:
    slotted, plain = "openai/cache-local", "openai/cache-plain"
    async with CacheEmulator() as emulator:
        models = {slotted: {"api_base": emulator.api_base, "cache_slots": 4},
                  plain: {"api_base": emulator.api_base}}
        async with running_daemon(short_tmp, models=models, default_model=slotted, summariser="off",
                                  **backend) as daemon:
            async with connected(daemon) as client:
                for conversation in ("a", "b", "c", "d", "e"):
                    for n in range(2):
                        await complete(client, prompt=f"q{n}", conversation_id=conversation, create=n == 0,
                                       model=slotted)
                await complete(client, prompt="mine", conversation_id="a", model=slotted,
                               extra_body={"id_slot": 9})
                await complete(client, prompt="plain", conversation_id="p", create=True, model=plain)
    bodies = emulator.requests
    assert all(body["cache_prompt"] is True for body in bodies[:11])
    slots = [body["id_slot"] for body in bodies[:10]]
    assert slots[0::2] == slots[1::2]  # each conversation keeps its slot from turn to turn
    assert all(0 <= slot < 4 for slot in slots) and len(set(slots)) > 1
    assert bodies[10]["id_slot"] == 9  # the client's own slot is kept
    assert "cache_prompt" not in bodies[11] and "id_slot" not in bodies[11]


def openai_marks(body: dict[str, Any]) -> list[str]:
    """The roles of the messages whose blocks carry an explicit OpenAI breakpoint, once a block."""
    return [m["role"] for m in body["messages"] if isinstance(m["content"], list)
            for block in m["content"] if "prompt_cache_breakpoint" in block]


async def test_openai_models_that_take_explicit_breakpoints_get_them_on_the_system_prompt_and_newest_message(
        short_tmp: Path, backend: dict[str, Any]) -> None:
    explicit, automatic = "openai/gpt-5.6", "openai/gpt-4o"
    async with CacheEmulator() as emulator:
        models = {name: {"api_base": emulator.api_base} for name in (explicit, automatic)}
        models["openai/gpt-5.6-off"] = {"api_base": emulator.api_base, "cache_placement": "off"}
        async with running_daemon(short_tmp, models=models, default_model=explicit, summariser="off",
                                  **backend) as daemon:
            async with connected(daemon) as client:
                await complete(client, prompt="one", conversation_id="o", create=True, system="be brief",
                               model=explicit)
                await complete(client, prompt="two", conversation_id="o", model=explicit)
                await complete(client, prompt="three", conversation_id="o", model=automatic)
                await complete(client, prompt="four", conversation_id="o", model="openai/gpt-5.6-off")
    first, second, third, fourth = emulator.requests
    assert openai_marks(first) == ["system", "user"] and openai_marks(second) == ["system", "user"]
    assert second["messages"][0]["content"] == [{"type": "text", "text": "be brief",
                                                 "prompt_cache_breakpoint": {"mode": "explicit"}}]
    assert [m["content"] for m in second["messages"][1:3]] == ["one", "answer 1"]  # history as it was
    assert openai_marks(third) == [] and openai_marks(fourth) == []


async def test_each_exchange_records_its_cost_and_the_cost_without_the_cache(
        short_tmp: Path, backend: dict[str, Any]) -> None:
    priced = "openai/gpt-4o"  # litellm's price list knows it, cached input at its own rate
    async with CacheEmulator() as emulator:
        async with running_daemon(short_tmp, models={priced: {"api_base": emulator.api_base}}, default_model=priced,
                                  summariser="off", **backend) as daemon:
            async with connected(daemon) as client:
                for n in range(2):
                    await complete(client, prompt=f"q{n}", conversation_id="p", create=n == 0, system=SYSTEM,
                                   model=priced)
        async with running_daemon(short_tmp, models={priced: {"api_base": emulator.api_base}}, default_model=priced,
                                  summariser="off", **backend) as daemon:
            async with connected(daemon) as client:
                cache = (await client.request("conversation:stats", {"conversation_id": "p"}))["cache"]
    first, second = cache["turns"]
    assert second["read"] >= MINIMUM
    assert first["cost"] > 0 and first["cost_uncached"] == first["cost"]  # nothing was read: the same
    assert second["cost_uncached"] > second["cost"] > 0  # the cached tokens were billed lower
    assert cache["cost_uncached"] == round(first["cost_uncached"] + second["cost_uncached"], 10)
    assert cache["models"][priced]["cost"] == cache["cost"]


async def test_health_gives_each_models_cache_reads_and_hit_rate_since_start(
        short_tmp: Path, backend: dict[str, Any]) -> None:
    model = "openai/cache-health"
    async with CacheEmulator() as emulator:
        async with running_daemon(short_tmp, models={model: {"api_base": emulator.api_base}}, default_model=model,
                                  summariser="off", **backend) as daemon:
            async with connected(daemon) as client:
                for n in range(2):
                    await complete(client, prompt=f"q{n}", conversation_id="h", create=n == 0, system=SYSTEM,
                                   model=model)
                health = await client.request("system:health", {})
    counts = health["completions"]["since_start"][model]
    read = sum(usage["prompt_tokens_details"]["cached_tokens"] for usage in emulator.usages)
    prompts = sum(usage["prompt_tokens"] for usage in emulator.usages)
    assert counts["cache_read"] == read >= MINIMUM
    assert counts["cache_hit_rate"] == round(read / prompts, 4)
