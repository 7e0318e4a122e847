"""Prompt-cache use is recorded: the cache reads a provider reports (through litellm's usage) are
stored with each exchange, shown by conversation:stats per turn and per model, and still there
after a restart. The provider is an emulator applying OpenAI's automatic prefix-cache rules, over
HTTP. Both storage backends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ksi_common.client import KsiClient
from tests.cache_emulator import MINIMUM, CacheEmulator
from tests.conftest import complete, connected, running_daemon

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
