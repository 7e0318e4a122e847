"""Provider faults played by the stub: retries, timeouts, refused connections, bad bodies,
auth errors and the circuit breaker; failures never leak into history."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import orjson
import pytest

from ksi_common.client import KsiClient
from ksi_common.errors import KsiError
from ksi_daemon.daemon import Daemon
from tests.conftest import complete, connected, running_daemon, stub_settings
from tests.stub_openai import Reply


def response_of(daemon: Daemon, response_id: str) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in daemon.layout.response_file(response_id).read_bytes().splitlines()]


def index_ids(daemon: Daemon, conversation_id: str) -> list[str]:
    path = daemon.layout.index_file(conversation_id)
    if not path.exists():
        return []
    return [orjson.loads(line)["response_id"] for line in path.read_bytes().splitlines()]


async def failing(client: KsiClient, **data: Any) -> tuple[KsiError, dict[str, Any]]:
    """Run a request expected to fail; its error and its final status."""
    ack = await client.request("completion:async", data)
    with pytest.raises(KsiError) as caught:
        await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 30})
    status = await client.request("completion:status", {"request_id": ack["request_id"]})
    assert status["status"] == "failed"
    assert status["reason"] == caught.value.code
    return caught.value, status


def unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# -- retries -----------------------------------------------------------------------------------


async def test_rate_limited_then_success_is_retried_after_retry_after(stub_daemon: Daemon, stub: Any) -> None:
    stub.enqueue(Reply(status=429, headers={"Retry-After": "0"}), "finally")
    async with connected(stub_daemon) as client:
        result = await complete(client, prompt="hello")
    assert result["content"] == "finally"
    assert result["attempts"] == 2
    assert len(stub.requests) == 2
    assistant = response_of(stub_daemon, result["response_id"])[-1]
    assert assistant["type"] == "assistant"
    first, second = assistant["attempts"]
    assert (first["attempt"], first["ok"], first["code"]) == (1, False, "rate_limited")
    assert first["retry_in"] == 0  # the provider's Retry-After wins over the backoff
    assert (second["attempt"], second["ok"]) == (2, True)


async def test_persistent_rate_limit_ends_rate_limited_with_a_hint(stub_daemon: Daemon, stub: Any) -> None:
    stub.enqueue(*[Reply(status=429, headers={"Retry-After": "0"})] * 3)
    async with connected(stub_daemon) as client:
        error, status = await failing(client, prompt="hello")
    assert error.code == "rate_limited"
    assert error.details["retry_after"] == 0
    assert len(stub.requests) == 3
    assert [a["code"] for a in response_of(stub_daemon, status["response_id"])[-1]["attempts"]] == ["rate_limited"] * 3


async def test_a_retry_after_beyond_the_max_delay_is_not_waited_for(stub_daemon: Daemon, stub: Any) -> None:
    stub.enqueue(Reply(status=429, headers={"Retry-After": "120"}), "too late")
    async with connected(stub_daemon) as client:
        error, _status = await failing(client, prompt="hello")
    assert error.code == "rate_limited"
    assert error.details["retry_after"] == 120
    assert len(stub.requests) == 1


@pytest.mark.parametrize("fault", [Reply(status=500), Reply(status=503), Reply(close=True)],
                         ids=["500", "503", "dropped-connection"])
async def test_transient_failure_then_success(stub_daemon: Daemon, stub: Any, fault: Reply) -> None:
    stub.enqueue(fault, "recovered")
    async with connected(stub_daemon) as client:
        result = await complete(client, prompt="hello")
    assert result["content"] == "recovered"
    assert result["attempts"] == 2
    assert len(stub.requests) == 2
    attempts = response_of(stub_daemon, result["response_id"])[-1]["attempts"]
    assert [a["ok"] for a in attempts] == [False, True]
    assert attempts[0]["code"] == "provider_error"


async def test_persistent_500_fails_after_the_configured_attempts(stub_daemon: Daemon, stub: Any) -> None:
    attempts = stub_daemon.settings.retry_attempts
    assert attempts == 3
    stub.enqueue(*[Reply(status=500)] * 5)
    async with connected(stub_daemon) as client:
        error, status = await failing(client, prompt="doomed", conversation_id="c500", create=True)
    assert error.code == "provider_error"
    assert error.details["status"] == 500
    assert error.details["request_id"] == status["request_id"]
    assert len(stub.requests) == attempts
    lines = response_of(stub_daemon, status["response_id"])
    assert [line["type"] for line in lines] == ["user", "error"]
    assert [a["attempt"] for a in lines[1]["attempts"]] == [1, 2, 3]
    assert not any(a["ok"] for a in lines[1]["attempts"])
    assert index_ids(stub_daemon, "c500") == []


async def test_unauthorized_is_not_retried(stub_daemon: Daemon, stub: Any) -> None:
    stub.enqueue(Reply(status=401), "never used")
    async with connected(stub_daemon) as client:
        error, status = await failing(client, prompt="hello")
    assert error.code == "provider_error"
    assert error.details["status"] == 401
    assert len(stub.requests) == 1
    assert len(response_of(stub_daemon, status["response_id"])[-1]["attempts"]) == 1
    assert "sk-test-dummy" not in orjson.dumps(response_of(stub_daemon, status["response_id"])).decode()


async def test_bad_request_is_not_retried(stub_daemon: Daemon, stub: Any) -> None:
    stub.enqueue(Reply(status=400), "never used")
    async with connected(stub_daemon) as client:
        error, _status = await failing(client, prompt="hello")
    assert error.code == "provider_error"
    assert len(stub.requests) == 1


async def test_a_slow_provider_times_out_per_attempt(short_tmp: Path, stub: Any) -> None:
    stub.enqueue(Reply(delay=0.5), Reply(delay=0.5))
    async with running_daemon(short_tmp, **stub_settings(stub, retry_attempts=2)) as daemon, \
            connected(daemon) as client:
        error, status = await failing(client, prompt="are you there?", timeout=0.1)
        attempts = response_of(daemon, status["response_id"])[-1]["attempts"]
    assert error.code == "timeout"
    assert len(stub.requests) == 2
    assert [a["code"] for a in attempts] == ["timeout", "timeout"]


async def test_connection_refused_is_a_provider_error(short_tmp: Path, stub: Any) -> None:
    dead = {"openai/dead": {"api_base": f"http://127.0.0.1:{unused_port()}/v1"}}
    async with running_daemon(short_tmp, **stub_settings(stub, models=dead)) as daemon, connected(daemon) as client:
        error, status = await failing(client, prompt="anyone?", model="openai/dead")
        attempts = response_of(daemon, status["response_id"])[-1]["attempts"]
    assert error.code == "provider_error"
    assert error.details["status"] == 500  # litellm reports a refused connection as a server error
    assert len(attempts) == daemon.settings.retry_attempts  # a refused connection may be transient
    assert stub.requests == []


@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings:UserWarning")  # the wrong-shape body
@pytest.mark.parametrize("body", ["{not json", "", '{"choices": "nope"}'], ids=["broken", "empty", "wrong-shape"])
async def test_a_malformed_body_is_a_provider_error(stub_daemon: Daemon, stub: Any, body: str) -> None:
    stub.enqueue(*[Reply(body=body)] * 3)
    async with connected(stub_daemon) as client:
        error, status = await failing(client, prompt="hello", conversation_id="bad", create=True)
    assert error.code == "provider_error"
    assert error.message
    assert index_ids(stub_daemon, "bad") == []
    assert response_of(stub_daemon, status["response_id"])[-1]["type"] == "error"


async def test_failures_leave_history_clean(short_tmp: Path, stub: Any) -> None:
    settings = stub_settings(stub, retry_attempts=1)
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        first = await complete(client, prompt="the good start", conversation_id="clean", create=True)
        for number, fault in enumerate([Reply(status=500), Reply(status=401), Reply(status=429),
                                        Reply(body="{oops"), Reply(close=True)]):
            stub.enqueue(fault)
            await failing(client, prompt=f"failed input {number}", conversation_id="clean")
        last = await complete(client, prompt="the good end", conversation_id="clean")
        assert index_ids(daemon, "clean") == [first["response_id"], last["response_id"]]
    assert [(m["role"], m["content"]) for m in stub.messages()] == [
        ("user", "the good start"), ("assistant", first["content"]), ("user", "the good end")]
    assert last["exchange"] == 2
    assert last["history"]["exchanges_total"] == 1


# -- circuit breaker ---------------------------------------------------------------------------


async def test_the_circuit_opens_after_consecutive_failures(short_tmp: Path, stub: Any) -> None:
    settings = stub_settings(stub, retry_attempts=1, circuit_failures=2, circuit_reset=60)
    stub.enqueue(Reply(status=500), Reply(status=502))
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        await client.request("monitor:subscribe", {"patterns": ["completion:error"]})
        first, _ = await failing(client, prompt="one")
        second, _ = await failing(client, prompt="two")
        third, _ = await failing(client, prompt="three")
        # the circuit is per model and api base: another openai/... model is still tried
        other = await complete(client, prompt="four", model="openai/stub-other")
        echo = await complete(client, prompt="echo still works", model="echo/x")
        health = await client.request("system:health")
        codes = []
        while len(codes) < 3:
            push = await client.next_push(timeout=10)
            assert push is not None
            codes.append(push["data"]["code"])
    key = f"openai/stub-model @ {stub.api_base}"
    assert (first.code, second.code) == ("provider_error", "provider_error")
    assert third.code == "provider_unavailable"
    assert third.details["provider"] == key
    assert 0 < third.details["retry_after"] <= 60
    assert codes == ["provider_error", "provider_error", "provider_unavailable"]
    assert len(stub.requests) == 3  # nothing reached the provider for stub-model while its circuit was open
    assert other["content"] == "stub answer to: four"
    assert "You said: echo still works" in echo["content"]
    circuit = health["completions"]["circuits"][key]
    assert circuit["state"] == "open"
    assert circuit["trips"] == 1
    assert circuit["consecutive_failures"] >= 2


async def test_one_failing_server_does_not_stop_other_models_of_its_provider(short_tmp: Path, stub: Any) -> None:
    dead = {"openai/dead": {"api_base": f"http://127.0.0.1:{unused_port()}/v1"}}
    settings = stub_settings(stub, models=dead, retry_attempts=1, circuit_failures=1, circuit_reset=60)
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        refused, _ = await failing(client, prompt="anyone?", model="openai/dead")
        still_open, _ = await failing(client, prompt="anyone now?", model="openai/dead")
        result = await complete(client, prompt="alive", model="openai/stub-model")
        circuits = (await client.request("system:health"))["completions"]["circuits"]
    assert (refused.code, still_open.code) == ("provider_error", "provider_unavailable")
    assert result["content"] == "stub answer to: alive"
    assert circuits[f"openai/dead @ {dead['openai/dead']['api_base']}"]["state"] == "open"
    assert list(circuits) == [f"openai/dead @ {dead['openai/dead']['api_base']}"]


async def test_a_half_open_circuit_closes_on_success(short_tmp: Path, stub: Any) -> None:
    settings = stub_settings(stub, retry_attempts=1, circuit_failures=1, circuit_reset=0.05)
    stub.enqueue(Reply(status=500))
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        await failing(client, prompt="one")
        key = f"openai/stub-model @ {stub.api_base}"
        daemon.completion.breaker.circuits[key].opened_at -= 1.0  # as if the reset time had passed
        result = await complete(client, prompt="two")
        health = await client.request("system:health")
    assert result["content"] == "stub answer to: two"
    assert health["completions"]["circuits"][key]["state"] == "closed"
    assert health["completions"]["circuits"][key]["consecutive_failures"] == 0


async def test_client_errors_do_not_open_the_circuit(short_tmp: Path, stub: Any) -> None:
    settings = stub_settings(stub, retry_attempts=1, circuit_failures=2)
    stub.enqueue(Reply(status=400), Reply(status=401), Reply(status=400))
    async with running_daemon(short_tmp, **settings) as daemon, connected(daemon) as client:
        for prompt in ("a", "b", "c"):
            error, _ = await failing(client, prompt=prompt)
            assert error.code == "provider_error"
        result = await complete(client, prompt="d")
    assert result["content"] == "stub answer to: d"
    assert len(stub.requests) == 4


async def test_an_unknown_provider_is_refused_before_it_is_queued_once_litellm_is_loaded(
        stub_daemon: Daemon, stub: Any) -> None:
    await stub_daemon.litellm.ensure_loaded()  # before, the ack does not wait for it (test_model_faults)
    async with connected(stub_daemon) as client:
        with pytest.raises(KsiError) as caught:
            await client.request("completion:async", {"prompt": "hi", "model": "nosuch/model"})
        listed = await client.request("conversation:list", {})
    assert caught.value.code == "model_not_found"
    assert caught.value.details["model"] == "nosuch/model"
    assert listed["total"] == 0
    assert stub.requests == []


async def test_a_request_naming_a_failed_requests_new_conversation_meanwhile_keeps_it(
        stub_daemon: Daemon, stub: Any) -> None:
    """The conversation the daemon made for a failed request is discarded only if no request came for
    it meanwhile: one admitted while the discard waited for the conversation's lock continues it."""
    gate = asyncio.Event()
    stub.model_gate["stub-model"] = gate
    stub.enqueue(Reply(status=400))
    async with connected(stub_daemon) as client:
        first = await client.request("completion:async", {"prompt": "one"})
        memory = stub_daemon.cache.cached(first["conversation_id"])
        assert memory is not None
        async with memory.lock:  # the failed request's discard waits here
            gate.set()
            while not getattr(memory.lock, "_waiters", None):
                await asyncio.sleep(0.01)
            second = await client.request("completion:async", {"prompt": "two",
                                                               "conversation_id": first["conversation_id"]})
        with pytest.raises(KsiError):
            await client.request("completion:wait", {"request_id": first["request_id"], "timeout": 30})
        result = await client.request("completion:wait", {"request_id": second["request_id"], "timeout": 30})
        shown = await client.request("conversation:show", {"conversation_id": first["conversation_id"]})
    assert result["conversation_id"] == first["conversation_id"] and result["exchange"] == 1
    assert [e["reply"]["content"] for e in shown["exchanges"]] == [result["content"]]
