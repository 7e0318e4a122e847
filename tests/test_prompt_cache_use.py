"""Prompt-cache use is recorded: the cache reads a provider reports (through litellm's usage) are
stored with each exchange, shown by conversation:stats and `ksi conversation show` per turn and per model, and still there
after a restart. The provider is an emulator applying OpenAI's automatic prefix-cache rules, over
HTTP. Both storage backends."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from ksi_cli.transcript_view import print_transcript
from ksi_common.client import KsiClient
from tests.cache_emulator import MINIMUM, CacheEmulator
from tests.conftest import complete, connected, running_daemon
from tests.test_cli_transcript_items import storage_env
from tests.test_inspect import ksi

pytestmark = pytest.mark.backends

MODEL = "openai/cache-model"
SYSTEM = " ".join(f"rule{i}" for i in range(MINIMUM + 200))  # long enough to be cached


def settings_for(emulator: CacheEmulator, backend: dict[str, Any]) -> dict[str, Any]:
    return {"models": {"openai/cache*": {"api_base": emulator.api_base}}, "default_model": MODEL,
            "summariser": "off", **backend}


async def stats(client: KsiClient) -> dict[str, Any]:
    return await client.request("conversation:stats", {"conversation_id": "c"})


async def test_cache_reads_are_stored_shown_per_turn_and_model_and_survive_restart(
        short_tmp: Path, backend: dict[str, Any]) -> None:
    async with CacheEmulator() as emulator:
        async with running_daemon(short_tmp, **settings_for(emulator, backend)) as daemon:
            async with connected(daemon) as client:
                for n, prompt in enumerate(["first question", "second question", "third question"]):
                    await complete(client, prompt=prompt, conversation_id="c", create=n == 0,
                                   system=SYSTEM, model=MODEL)
                before = await stats(client)
        reported = [u["prompt_tokens_details"]["cached_tokens"] for u in emulator.usages]
        assert reported[0] == 0 and reported[1] >= MINIMUM and reported[2] >= reported[1]
        cache = before["cache"]
        assert [t["read"] for t in cache["turns"]] == reported
        assert cache["read"] == sum(reported)
        prompts = [u["prompt_tokens"] for u in emulator.usages]
        assert cache["turns"][1]["hit_rate"] == round(reported[1] / prompts[1], 4)
        assert cache["models"][MODEL]["read"] == sum(reported)
        assert cache["hit_rate"] == round(sum(reported) / sum(prompts), 4)
        async with running_daemon(short_tmp, **settings_for(emulator, backend)) as daemon:
            async with connected(daemon) as client:
                after = await stats(client)
        assert after["cache"] == cache
        shown = ksi("conversation", "show", "c", "--var-dir", str(short_tmp / "var"), cwd=short_tmp,
                    env=storage_env(backend))
        assert shown.returncode == 0, shown.stderr
        readable = Console(record=True, width=200, color_system=None)
        print_transcript(json.loads(shown.stdout), readable)  # what `show` prints on a terminal
        text = readable.export_text()
        rate = cache["turns"][1]["hit_rate"]
        assert f"cache {rate:.0%} ({reported[1]} read, 0 written)" in text
        model_rate = cache["models"][MODEL]["hit_rate"]
        assert f"{MODEL}: cache {model_rate:.0%} ({sum(reported)} read, 0 written)" in text


async def test_openai_requests_carry_the_conversations_cache_key_unless_the_client_sent_one_or_it_is_off(
        short_tmp: Path, backend: dict[str, Any]) -> None:
    async with CacheEmulator() as emulator:
        settings = settings_for(emulator, backend)
        settings["models"]["openai/cache-off*"] = {"api_base": emulator.api_base, "cache_placement": "off"}
        async with running_daemon(short_tmp, **settings) as daemon:
            async with connected(daemon) as client:
                await complete(client, prompt="one", conversation_id="c", create=True, model=MODEL)
                await complete(client, prompt="two", conversation_id="c", model=MODEL,
                               options={"prompt_cache_key": "mine"})
                await complete(client, prompt="three", conversation_id="c", model="openai/cache-off-model")
    keys = [body.get("prompt_cache_key") for body in emulator.requests]
    assert keys == ["ksi:c", "mine", None]


def marked(body: dict[str, Any]) -> list[str]:
    """Where a Messages request carries breakpoints: 'system' or the role of a marked message."""
    places = ["system" for block in body.get("system") or [] if "cache_control" in block]
    for message in body["messages"]:
        content = message["content"]
        if isinstance(content, list) and any("cache_control" in block for block in content):
            places.append(message["role"])
    return places


async def test_anthropic_requests_carry_ksis_breakpoints_and_read_the_cache_unless_placement_is_off(
        short_tmp: Path, backend: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHE_EMULATOR_KEY", "sk-ant-local")
    async with CacheEmulator() as emulator:
        where = {"api_base": emulator.api_base.removesuffix("/v1"), "api_key_env": "CACHE_EMULATOR_KEY"}
        settings = {**settings_for(emulator, backend), "default_model": "anthropic/cache-model"}
        settings["models"] = {"anthropic/cache-model": where, "anthropic/cache-off": {**where, "cache_placement": "off"}}
        async with running_daemon(short_tmp, **settings) as daemon:
            async with connected(daemon) as client:
                for n, prompt in enumerate(["first question", "second question", "third question"]):
                    await complete(client, prompt=prompt, conversation_id="a", create=n == 0,
                                   system=SYSTEM, model="anthropic/cache-model")
                await complete(client, prompt="fourth", conversation_id="a", model="anthropic/cache-off")
                shown = await client.request("conversation:stats", {"conversation_id": "a"})
    assert [marked(body) for body in emulator.anthropic_requests] == [["system", "user"]] + \
        [["system", "assistant", "user"]] * 2 + [[]]
    reads = [u["cache_read_input_tokens"] for u in emulator.anthropic_usages]
    assert reads[0] == 0 and reads[1] > MINIMUM and reads[2] > reads[1] and reads[3] == 0
    assert [t["read"] for t in shown["cache"]["turns"]] == reads
    assert shown["cache"]["turns"][0]["created"] == emulator.anthropic_usages[0]["cache_creation_input_tokens"] > 0
