"""Faults of a model's configuration in KSI's own words, on the socket and the HTTP door: a model
name no provider answers to (with the closest names), a missing provider key; neither is retried
nor opens a circuit, and neither leaves an empty conversation behind. A circuit opened because a
local server was not up yet closes as soon as the server answers."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from ksi_common.client import KsiClient
from ksi_common.errors import KsiError
from ksi_daemon.daemon import Daemon
from ksi_daemon.services.resilience import PROBE_INTERVAL
from tests.conftest import complete, connected, running_daemon, running_http_daemon, stub_settings
from tests.stub_openai import Reply, StubOpenAI
from tests.test_completion_faults import failing, response_of, unused_port


def stored(daemon: Daemon) -> set[str]:
    """Every conversation file of the var dir (index, metadata): what a refused turn must not leave."""
    layout = daemon.layout
    found = {*layout.conversations_dir.glob("*"), *(layout.root / "state" / "conversations").glob("*")}
    return {str(p.relative_to(layout.root)) for p in found}


async def listed(client: KsiClient) -> int:
    return int((await client.request("conversation:list", {}))["total"])


async def test_a_wrong_model_name_is_model_not_found_with_the_closest_names(short_tmp: Path) -> None:
    async with running_daemon(short_tmp) as daemon, connected(daemon) as client:
        await daemon.litellm.ensure_loaded()  # loaded: the ack itself refuses the name
        for wrong in ("ecko/demo", "echo-demo"):
            with pytest.raises(KsiError) as caught:
                await client.request("completion:async", {"prompt": "hi", "model": wrong})
            error = caught.value
            assert error.code == "model_not_found"
            assert "did you mean echo/demo?" in error.message and "ksi models" in error.message
            assert error.details["suggestions"][0] == "echo/demo"
            assert "litellm." not in error.message and "LLM Provider" not in error.message
        assert await listed(client) == 0
        assert stored(daemon) == set()
        # a name litellm knows a close one of: its names are searched too
        with pytest.raises(KsiError) as caught:
            await client.request("completion:async", {"prompt": "hi", "model": "gpt-4oo"})
        assert caught.value.code == "model_not_found" and "gpt-4o" in caught.value.details["suggestions"]


async def test_before_litellm_is_loaded_the_ack_does_not_wait_for_it_and_the_call_refuses_the_name(
        short_tmp: Path) -> None:
    async with running_daemon(short_tmp, litellm_preload=False) as daemon, connected(daemon) as client:
        ack = await client.request("completion:async", {"prompt": "hi", "model": "ecko/demo"})
        with pytest.raises(KsiError) as caught:
            await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 30})
        assert caught.value.code == "model_not_found"
        assert "did you mean echo/demo?" in caught.value.message
        assert await listed(client) == 0
        assert stored(daemon) == set()


async def test_a_wrong_model_name_at_the_http_door(short_tmp: Path, stub: StubOpenAI) -> None:
    async with running_http_daemon(short_tmp, **stub_settings(stub)) as http, \
            httpx.AsyncClient(base_url=http.base_url, headers={"Authorization": f"Bearer {http.token}"},
                              timeout=30) as api:
        chat = await api.post("/v1/chat/completions",
                               json={"model": "ecko/demo", "messages": [{"role": "user", "content": "hi"}]})
        responses = await api.post("/v1/responses", json={"model": "ecko/demo", "input": "hi"})
        async with connected(http.daemon) as client:
            assert await listed(client) == 0
        assert stored(http.daemon) == set()
    for reply in (chat, responses):
        assert reply.status_code == 404, reply.text
        error = reply.json()["error"]
        assert error["code"] == "model_not_found"
        assert "did you mean echo/demo?" in error["message"] and "ksi models" in error["message"]


def keyless(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)


async def test_a_missing_key_names_the_variable_and_is_not_retried(
        short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keyless(monkeypatch)
    async with running_daemon(short_tmp, retry_attempts=3, circuit_failures=1) as daemon, \
            connected(daemon) as client:
        error, status = await failing(client, prompt="hi", model="openai/gpt-4o")
        health = await client.request("system:health")
        assert await listed(client) == 0  # the conversation made for the turn is gone with it
        assert stored(daemon) == set()
        attempts = response_of(daemon, status["response_id"])[-1]["attempts"]
    assert error.code == "api_key_missing"
    assert "OPENAI_API_KEY" in error.message and ".env" in error.message and "own environment" in error.message
    assert error.details["variables"] == ["OPENAI_API_KEY"]
    assert "litellm" not in error.message.lower()
    assert len(attempts) == 1  # a configuration fault: not retried
    assert health["completions"]["circuits"] == {}  # and the provider is not counted as failing


async def test_a_missing_key_at_the_http_door(short_tmp: Path, stub: StubOpenAI,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    keyless(monkeypatch)
    async with running_http_daemon(short_tmp, **stub_settings(stub)) as http, \
            httpx.AsyncClient(base_url=http.base_url, headers={"Authorization": f"Bearer {http.token}"},
                              timeout=30) as api:
        reply = await api.post("/v1/chat/completions",
                               json={"model": "openai/gpt-4o", "messages": [{"role": "user", "content": "hi"}]})
        assert stored(http.daemon) == set()
    assert reply.status_code == 503, reply.text
    error = reply.json()["error"]
    assert error["code"] == "api_key_missing" and "OPENAI_API_KEY" in error["message"]


async def test_a_bad_request_neither_retries_nor_counts_against_the_provider(short_tmp: Path,
                                                                            stub: StubOpenAI) -> None:
    stub.enqueue(Reply(status=400), Reply(status=400))
    async with running_daemon(short_tmp, **stub_settings(stub, circuit_failures=1)) as daemon, \
            connected(daemon) as client:
        for _ in range(2):
            error, _status = await failing(client, prompt="refused")
            assert error.code == "provider_error"
        result = await complete(client, prompt="fine")
        health = await client.request("system:health")
    assert result["content"] == "stub answer to: fine"
    assert len(stub.requests) == 3
    assert all(c["consecutive_failures"] == 0 and c["trips"] == 0
               for c in health["completions"]["circuits"].values())


async def test_a_circuit_opened_before_a_local_server_was_up_closes_when_it_answers(short_tmp: Path) -> None:
    port = unused_port()
    models = {"openai/local": {"api_base": f"http://127.0.0.1:{port}/v1"}}
    async with running_daemon(short_tmp, models=models, retry_attempts=1, circuit_failures=1,
                              circuit_reset=600) as daemon, connected(daemon) as client:
        refused, _ = await failing(client, prompt="anyone?", model="openai/local", conversation_id="c", create=True)
        still_down, _ = await failing(client, prompt="still nobody?", model="openai/local", conversation_id="c")
        assert (refused.code, still_down.code) == ("provider_error", "provider_unavailable")
        async with StubOpenAI(port=port):
            # the probe's "no" of a moment ago is kept for at most PROBE_INTERVAL, then asked again
            for _ in range(100):
                try:
                    result = await complete(client, prompt="up now", model="openai/local", conversation_id="c")
                    break
                except KsiError as error:
                    assert error.code == "provider_unavailable"
                    await asyncio.sleep(PROBE_INTERVAL / 10)
            health = await client.request("system:health")
    assert result["content"] == "stub answer to: up now"
    assert list(health["completions"]["circuits"].values())[0]["state"] == "closed"


@pytest.mark.backends
async def test_a_first_turn_that_fails_leaves_no_empty_conversation(short_tmp: Path, stub: StubOpenAI,
                                                                   backend: dict[str, Any]) -> None:
    stub.enqueue(Reply(status=400))
    async with running_daemon(short_tmp, **stub_settings(stub), **backend) as daemon, \
            connected(daemon) as client:
        error, status = await failing(client, prompt="refused")
        assert error.code == "provider_error"
        assert await listed(client) == 0
        with pytest.raises(KsiError) as gone:
            await client.request("conversation:show", {"conversation_id": status["conversation_id"]})
        assert gone.value.code == "conversation_not_found"
        # the failure itself is still on record, by its response id
        shown = await client.request("response:show", {"response_id": status["response_id"]})
        assert shown["status"] == "failed" and shown["exchange"] is None
        # a conversation the client named with `create` stays, empty (it chose the id)
        stub.enqueue(Reply(status=400))
        await failing(client, prompt="refused too", conversation_id="mine", create=True)
        assert await listed(client) == 1
        result = await complete(client, prompt="works")
        assert await listed(client) == 2 and result["exchange"] == 1


async def test_a_model_the_provider_does_not_have_is_model_not_found_and_not_retried(
        short_tmp: Path, stub: StubOpenAI) -> None:
    stub.enqueue(Reply(status=404, body='{"error": {"message": "The model `stub-modle` does not exist", '
                                        '"type": "invalid_request_error", "code": "model_not_found"}}'))
    async with running_daemon(short_tmp, **stub_settings(stub, retry_attempts=3)) as daemon, \
            connected(daemon) as client:
        error, status = await failing(client, prompt="hi", model="openai/stub-modle")
        attempts = response_of(daemon, status["response_id"])[-1]["attempts"]
        assert await listed(client) == 0
    assert error.code == "model_not_found"
    assert "the provider answered that it has no model 'openai/stub-modle'" in error.message
    assert "did you mean openai/stub-model?" in error.message  # the default model is a known name
    assert "does not exist" in error.details["provider_message"]
    assert len(attempts) == 1 and len(stub.requests) == 1
