"""Limits for the pool: a model's concurrency limit, the pool's own limit and a model's rates per
minute hold over three daemon processes sharing one database, not per daemon; one daemon (JSONL)
keeps its rates too."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from ksi_common.client import KsiClient
from ksi_common.errors import KsiError
from tests.conftest import complete, connected, running_daemon, stub_settings
from tests.test_crash import DaemonProcess
from tests.test_pool_order import daemon_processes, stored


async def turns_on(daemons: list[DaemonProcess], model: str, count: int, prefix: str) -> list[dict[str, Any] | str]:
    """`count` turns of `model`, each in a conversation of its own, spread over the daemons and sent
    at once; each one's result, or the code it failed with."""

    async def one(i: int) -> dict[str, Any] | str:
        async with KsiClient(daemons[i % len(daemons)].socket) as client:
            try:
                ack = await client.request("completion:async", {"prompt": f"{prefix} {i}", "model": model,
                                                                 "conversation_id": f"{prefix}-{i}", "create": True})
                return dict(await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 120}))
            except KsiError as error:
                return f"{error.code} {error.details.get('retry_after')}"

    return list(await asyncio.gather(*(one(i) for i in range(count))))


def models(stub: Any, **limits: dict[str, Any]) -> str:
    return json.dumps({**{f"openai/{name}*": {"api_base": stub.api_base, **more} for name, more in limits.items()},
                       "openai/stub*": {"api_base": stub.api_base}})


async def test_a_model_limit_and_the_pool_limit_hold_over_three_daemons(short_tmp: Path, pg_url: str,
                                                                        stub: Any) -> None:
    stub.hold = 0.2  # calls that may overlap do
    async with daemon_processes(short_tmp, pg_url, stub, KSI_MODELS=models(stub, **{"stub-two": {"max_concurrency": 2}}),
                                KSI_POOL_MAX_CONCURRENCY="3", KSI_MAX_CONCURRENCY="8") as daemons:
        limited = await turns_on(daemons, "openai/stub-two", 9, "two")
        assert all(isinstance(r, dict) for r in limited), limited
        assert stub.max_in_flight == 2  # the model's limit of 2, over all three daemons together
        stub.max_in_flight = 0
        pooled = await turns_on(daemons, "openai/stub-model", 12, "any")
        assert all(isinstance(r, dict) for r in pooled), pooled
        assert stub.max_in_flight == 3  # the pool's limit, though each daemon may make 8 calls at once
    # every turn reached the model (a daemon stalled past its heartbeat timeout on a loaded machine
    # may see its turn taken over and run again: that is takeover's business, not the limits')
    sent = {r["messages"][-1]["content"] for r in stub.requests}
    assert sent == {f"two {i}" for i in range(9)} | {f"any {i}" for i in range(12)}


async def test_a_model_rate_per_minute_holds_over_three_daemons(short_tmp: Path, pg_url: str, stub: Any) -> None:
    async with daemon_processes(short_tmp, pg_url, stub,
                                KSI_MODELS=models(stub, **{"stub-rated": {"requests_per_minute": 4}})) as daemons:
        outcomes = await turns_on(daemons, "openai/stub-rated", 9, "rated")
        answered = [o for o in outcomes if isinstance(o, dict)]
        refused = [o for o in outcomes if isinstance(o, str)]
        assert len(answered) == 4 and len(stub.requests) == 4  # never more than 4 calls in the minute
        assert len(refused) == 5 and all(r.startswith("rate_limited ") for r in refused), refused
        assert all(0 < float(r.split()[1]) <= 60 for r in refused)  # when the minute has room again
        # a refused turn stored nothing in its conversation; another model is not held back
        for i, outcome in enumerate(outcomes):
            assert len(await stored(daemons[0].var, pg_url, f"rated-{i}")) == (1 if isinstance(outcome, dict) else 0)
        assert all(isinstance(r, dict) for r in await turns_on(daemons, "openai/stub-model", 3, "free"))


@pytest.mark.backends
async def test_a_model_rate_of_tokens_per_minute_refuses_the_call_that_would_pass_it(
        short_tmp: Path, stub: Any, backend: dict[str, Any]) -> None:
    limited = {"openai/stub-tokens*": {"api_base": stub.api_base, "tokens_per_minute": 40}}
    async with running_daemon(short_tmp, **stub_settings(stub, models=limited), **backend) as daemon, \
            connected(daemon) as client:
        await daemon.litellm.ensure_loaded()  # its import, seconds on a busy machine, is not what this waits for
        first = await complete(client, model="openai/stub-tokens", prompt="one two three four five six",
                               conversation_id="t", create=True)
        assert first["usage"]["total_tokens"] < 40
        with pytest.raises(KsiError) as refused:  # the first call's usage and this prompt pass 40
            await complete(client, model="openai/stub-tokens", prompt=" ".join(["word"] * 30), conversation_id="t")
        assert refused.value.code == "rate_limited"
        assert len(stub.requests) == 1
        shown = await client.request("conversation:show", {"conversation_id": "t"})
        assert shown["conversation"]["exchanges"] == 1
