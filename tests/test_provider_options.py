"""Request options cannot send a configured key to a host the settings did not name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ksi_common.errors import KsiError
from tests.conftest import complete, connected, running_daemon, stub_settings
from tests.stub_openai import StubOpenAI


@pytest.mark.parametrize("options", [
    {"base_url": "EVIL"},
    {"extra_headers": {"X-Forward-To": "EVIL"}},
    {"api_version": "2024-01-01"},
    {"custom_llm_provider": "openai"},
    {"aws_region_name": "us-east-1"},
])
async def test_routing_options_are_refused(short_tmp: Path, stub: Any, options: dict[str, Any]) -> None:
    async with StubOpenAI() as evil:
        options = {k: (evil.api_base if v == "EVIL" else v) for k, v in options.items()}
        async with running_daemon(short_tmp, **stub_settings(stub)) as daemon, connected(daemon) as client:
            for target in ({}, {"conversation_id": "brand-new", "create": True}):
                with pytest.raises(KsiError) as caught:
                    await client.request("completion:async", {"prompt": "hi", "options": options, **target})
                assert caught.value.code == "validation_error"
                assert set(caught.value.details["fields"]) == {f"options.{name}" for name in options}
            assert not daemon.layout.meta_file("brand-new").exists()
            assert not daemon.layout.index_file("brand-new").exists()
            result = await complete(client, prompt="plain")
            assert result["content"] == "stub answer to: plain"
        assert evil.requests == []


async def test_an_option_the_model_settings_allow_goes_through(short_tmp: Path, stub: Any) -> None:
    async with StubOpenAI() as other:
        settings = stub_settings(stub, models={"openai/stub-free": {"allow_options": ["base_url"]}})
        async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
            result = await complete(client, prompt="hi", model="openai/stub-free",
                                    options={"base_url": other.api_base, "seed": 7})
            assert result["content"] == "stub answer to: hi"
            # the same option for a model that does not allow it
            with pytest.raises(KsiError) as caught:
                await complete(client, prompt="hi", model="openai/stub-model", options={"base_url": other.api_base})
            assert caught.value.code == "validation_error"
        assert len(other.requests) == 1 and stub.requests == []


async def test_harmless_options_still_pass(stub_daemon: Any, stub: Any) -> None:
    async with connected(stub_daemon) as client:
        await complete(client, prompt="hi", options={"top_p": 0.5, "seed": 3, "stop": ["x"]})
    assert stub.requests[-1]["top_p"] == 0.5 and stub.requests[-1]["seed"] == 3
