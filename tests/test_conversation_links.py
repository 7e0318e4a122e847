"""A conversation's ids in other tools (`external_ids`), and `completion:models`, in-process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ksi_common.errors import KsiError
from tests.conftest import complete, connected, running_daemon


async def test_external_ids_are_recorded_when_the_conversation_is_created(short_tmp: Path) -> None:
    async with running_daemon(short_tmp) as daemon, connected(daemon) as client:
        first = await complete(client, prompt="hi", model="echo/demo", conversation_id="llm-01abc", create=True,
                               external_ids={"llm": "01abc"})
        # a later request cannot rewrite the link of an existing conversation
        await complete(client, prompt="again", conversation_id="llm-01abc", external_ids={"llm": "other"})
        shown = await client.request("conversation:show", {"conversation_id": "llm-01abc"})
        listed = await client.request("conversation:list", {})

    assert first["conversation_id"] == "llm-01abc"
    assert shown["conversation"]["external_ids"] == {"llm": "01abc"}
    assert listed["conversations"][0]["external_ids"] == {"llm": "01abc"}
    meta = json.loads(daemon.layout.meta_file("llm-01abc").read_text())
    assert meta["extra"]["external_ids"] == {"llm": "01abc"}


@pytest.mark.parametrize("external_ids", [{"llm": "../escape"}, {"../tool": "01abc"}, {"llm": ""}])
async def test_unsafe_external_ids_are_refused(short_tmp: Path, external_ids: dict[str, str]) -> None:
    async with running_daemon(short_tmp) as daemon, connected(daemon) as client:
        with pytest.raises(KsiError) as caught:
            await client.request("completion:async", {"prompt": "hi", "model": "echo/demo", "create": True,
                                                      "conversation_id": "llm-01abc", "external_ids": external_ids})
    assert caught.value.code == "validation_error"
    assert any(name.startswith("external_ids") for name in caught.value.details["fields"])
    assert not daemon.layout.meta_file("llm-01abc").exists()
    assert not daemon.layout.index_file("llm-01abc").exists()


async def test_models_offered_by_name(short_tmp: Path) -> None:
    models = {"openai/*": {"context_window": 1000}, "openai/gpt-4o": {"context_window": 128000},
              "ollama/qwen3:4b": {}}
    async with running_daemon(short_tmp, models=models, default_model="openai/gpt-4o-mini") as daemon, \
            connected(daemon) as client:
        offered = await client.request("completion:models")
    assert offered == {"default": "openai/gpt-4o-mini",
                       "models": ["openai/gpt-4o-mini", "openai/gpt-4o", "ollama/qwen3:4b", "echo/demo"]}
