"""Failures are named in the daemon log: code, model, conversation and request id on every line."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from ksi_common.client import KsiClient
from ksi_common.errors import KsiError
from tests.conftest import complete, running_daemon, stub_settings
from tests.stub_openai import Reply


def named(entries: list[dict[str, Any]], event: str) -> list[dict[str, Any]]:
    return [entry for entry in entries if entry["event"] == event]


async def test_retries_failures_and_circuit_changes_are_logged(short_tmp: Path, stub: Any) -> None:
    stub.enqueue(*[Reply(status=500, body='{"error": {"message": "boom"}}') for _ in range(3)])
    settings = stub_settings(stub, retry_attempts=3, circuit_failures=3, circuit_reset=0.2)
    async with running_daemon(short_tmp, **settings) as daemon, KsiClient(daemon.settings.socket) as client:
        with capture_logs() as entries:
            with pytest.raises(KsiError) as failed:
                await complete(client, prompt="will fail", conversation_id="conv-logged", create=True)
        assert failed.value.code == "provider_error"
        retries = named(entries, "completion_retry")
        assert len(retries) == 2
        for entry in retries + named(entries, "completion_failed") + named(entries, "circuit_opened"):
            assert entry["log_level"] == "warning"
            assert entry["code"] in ("provider_error", "provider_unavailable")
            assert entry["model"] == "openai/stub-model"
            assert entry["conversation_id"] == "conv-logged"
            assert entry["request_id"].startswith("req")
        assert len(named(entries, "completion_failed")) == 1
        assert len(named(entries, "circuit_opened")) == 1
        # the provider recovers: the half-open probe succeeds and the circuit closes, logged too
        await asyncio.sleep(0.25)
        with capture_logs() as entries:
            await complete(client, prompt="works now", conversation_id="conv-logged")
        closed = named(entries, "circuit_closed")
        assert len(closed) == 1 and closed[0]["conversation_id"] == "conv-logged"


async def test_overload_is_logged_with_its_code(short_tmp: Path, stub: Any) -> None:
    stub.hold = 1.0
    async with running_daemon(short_tmp, max_queued=1, max_concurrency=1, **stub_settings(stub)) as daemon, \
            KsiClient(daemon.settings.socket) as client:
        with capture_logs() as entries:
            codes = []
            for _ in range(5):
                try:
                    await client.request("completion:async", {"prompt": "queued"})
                except KsiError as error:
                    codes.append(error.code)
        assert codes and set(codes) == {"overloaded"}
        overloaded = named(entries, "overloaded")
        # every refusal within a second is one line: an overload does not flood the log
        assert len(overloaded) == 1 and overloaded[0]["code"] == "overloaded"
