"""The daemon's concurrency limits hold over every provider call: plain completions and the member
and arbiter calls of consortium runs count against the same global and per-model limits."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from ksi_common.client import KsiClient
from tests.conftest import connected, running_daemon
from tests.stub_openai import StubOpenAI

HOLD = 0.05  # each call is held this long at the stub, so calls that may overlap do


def verdict(_messages: list[dict[str, Any]]) -> str:
    """Every call is answered with a confident verdict: good enough for a member, final for the arbiter."""
    return json.dumps({"synthesis": "agreed", "confidence": 0.95, "dissent": "", "refinement_areas": [],
                       "needs_iteration": False, "ranking": [1]})


async def mixed_load(client: KsiClient) -> list[dict[str, Any]]:
    """Four plain completions and two consortium runs (three calls each), all submitted at once."""
    await client.request("consortium:save", {"name": "pair", "members": ["openai/shared:2"],
                                             "arbiter": "openai/shared"})
    requests = [{"prompt": f"plain {i}", "model": "openai/shared", "conversation_id": f"plain-{i}", "create": True}
                for i in range(4)]
    requests += [{"prompt": f"asked {i}", "model": "consortium/pair", "conversation_id": f"run-{i}", "create": True}
                 for i in range(2)]
    acks = await asyncio.gather(*(client.request("completion:async", r) for r in requests))
    return list(await asyncio.gather(*(client.request("completion:wait", {"request_id": a["request_id"],
                                                                          "timeout": 60}) for a in acks)))


async def test_a_per_model_limit_of_one_holds_across_completions_and_consortium_runs(short_tmp: Path) -> None:
    async with StubOpenAI(answer=verdict) as stub:
        stub.hold = HOLD
        models = {"openai/shared*": {"api_base": stub.api_base, "max_concurrency": 1}}
        async with running_daemon(short_tmp, models=models, max_concurrency=8) as daemon, \
                connected(daemon) as client:
            results = await mixed_load(client)
    assert all(r.get("content") for r in results), results
    assert len(stub.requests) == 4 + 2 * 3  # every call reached the stub
    assert stub.max_in_flight == 1


async def test_the_global_limit_holds_across_completions_and_consortium_runs(short_tmp: Path) -> None:
    async with StubOpenAI(answer=verdict) as stub:
        stub.hold = HOLD
        models = {"openai/shared*": {"api_base": stub.api_base}}
        async with running_daemon(short_tmp, models=models, max_concurrency=2) as daemon, \
                connected(daemon) as client:
            results = await mixed_load(client)
    assert all(r.get("content") for r in results), results
    assert len(stub.requests) == 4 + 2 * 3
    assert stub.max_in_flight == 2  # two at once, never three
