"""A key-less local OpenAI-compatible server works; a connection failure names the URL it tried."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ksi_common.client import KsiClient
from ksi_common.errors import KsiError
from tests.conftest import complete, running_daemon, stub_settings


async def test_a_local_server_without_a_key(short_tmp: Path, stub: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY")
    async with running_daemon(short_tmp, **stub_settings(stub)) as daemon, KsiClient(daemon.settings.socket) as client:
        result = await complete(client, prompt="no key here")
        streamed = await complete(client, prompt="streamed too", stream=True)
    assert result["content"] == "stub answer to: no key here"
    assert streamed["content"] == "stub answer to: streamed too"
    # the SDK insists on some key: the daemon's placeholder, not one the user had to make up
    assert {headers.get("Authorization") for headers in stub.headers} == {"Bearer no-key"}


async def test_connection_error_names_the_url(short_tmp: Path) -> None:
    down = "http://127.0.0.1:9/v1"  # the discard port: nothing listens
    settings = {"models": {"openai/down": {"api_base": down}}, "retry_attempts": 1}
    async with running_daemon(short_tmp, **settings) as daemon, KsiClient(daemon.settings.socket) as client:
        with pytest.raises(KsiError) as failed:
            await complete(client, prompt="anyone?", model="openai/down")
    assert failed.value.code == "provider_error"
    assert down in failed.value.message
    assert failed.value.details["url"] == down
