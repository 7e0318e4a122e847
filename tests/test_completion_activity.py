"""`system:health` counts what completions did since the start, per model, and keeps the latest
failures: it tells the truth right after a provider error, whichever door asks."""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Any

import pytest

from ksi_common.errors import KsiError
from tests.conftest import complete, connected, running_daemon, stub_settings
from tests.stub_openai import Reply, StubOpenAI


async def test_health_counts_requests_failures_latency_and_tokens_per_model(short_tmp: Path, stub: StubOpenAI) -> None:
    async with running_daemon(short_tmp, **stub_settings(stub, retry_attempts=1)) as daemon, \
            connected(daemon) as client:
        before = (await client.request("system:health", {}))["completions"]
        assert (before["since_start"], before["recent_errors"], before["failing"]) == ({}, [], [])

        first = await complete(client, prompt="one two three", model="openai/stub-good")
        await complete(client, prompt="four", model="openai/stub-good", conversation_id=first["conversation_id"])
        stub.model_script["stub-bad"] = deque([Reply(status=500)])
        with pytest.raises(KsiError) as failed:
            await complete(client, prompt="this one fails", model="openai/stub-bad", conversation_id="doomed",
                           create=True)
        health = (await client.request("system:health", {}))["completions"]

        good, bad = health["since_start"]["openai/stub-good"], health["since_start"]["openai/stub-bad"]
        assert (good["requests"], good["succeeded"], good["failed"]) == (2, 2, 0)
        assert good["tokens_in"] > 0 and good["tokens_out"] > 0
        assert good["latency_ms_mean"] > 0 and good["latency_ms_last"] > 0 and good["last_outcome"] == "ok"
        assert (bad["requests"], bad["succeeded"], bad["failed"], bad["tokens_in"]) == (1, 0, 1, 0)
        assert bad["latency_ms_mean"] is None and bad["last_outcome"] == failed.value.code
        [error] = health["recent_errors"]
        assert (error["code"], error["model"], error["conversation_id"]) == (
            failed.value.code, "openai/stub-bad", "doomed")
        assert error["code"] == "provider_error" and error["ts"].endswith("Z")
        assert health["failing"] == ["openai/stub-bad"]

        await complete(client, prompt="works again", model="openai/stub-bad", conversation_id="doomed")
        health = (await client.request("system:health", {}))["completions"]
        assert health["failing"] == []  # its latest request answered
        assert health["since_start"]["openai/stub-bad"]["requests"] == 2
        assert len(health["recent_errors"]) == 1  # the error stays listed among the recent ones


async def test_recent_errors_keep_the_newest_and_cut_long_messages(short_tmp: Path, stub: StubOpenAI) -> None:
    async with running_daemon(short_tmp, **stub_settings(stub, retry_attempts=1)) as daemon, \
            connected(daemon) as client:
        stub.model_script["stub-down"] = deque([Reply(status=500)] * 25)
        for number in range(25):
            with pytest.raises(KsiError):
                await complete(client, prompt=f"try {number}", model="openai/stub-down",
                               conversation_id=f"try-{number}", create=True)
        health: dict[str, Any] = (await client.request("system:health", {}))["completions"]
    assert len(health["recent_errors"]) == 20
    assert health["recent_errors"][0]["conversation_id"] == "try-24"  # newest first
    assert all(len(e["message"]) <= 300 for e in health["recent_errors"])
    assert health["since_start"]["openai/stub-down"]["failed"] == 25


def test_counts_are_kept_for_the_most_recently_used_models_only() -> None:
    from ksi_daemon.services.completion.activity import MODELS_KEPT, CompletionActivity

    activity = CompletionActivity()
    activity.failed("echo/first", "provider_error", "down", "ts", "req-0", None)
    for i in range(MODELS_KEPT):
        activity.succeeded(f"echo/m{i}", 1.0, {}, None, "ts")
        if i == MODELS_KEPT // 2:
            activity.cancelled("echo/first")  # used again: kept
    activity.succeeded("echo/one-more", 1.0, {}, None, "ts")
    report = activity.report()
    assert len(report["since_start"]) == MODELS_KEPT
    assert "echo/first" in report["since_start"] and report["failing"] == ["echo/first"]
    assert "echo/m0" not in report["since_start"] and "echo/one-more" in report["since_start"]
