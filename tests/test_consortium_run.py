"""A consortium run on its own (no daemon): what it guarantees when it is cancelled.

The daemon-level tests cannot choose which member's call log is slow; here one is held, so a
run that ends before all its members' logs are written is caught every time, not now and then.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import orjson

from ksi_common.layout import VarLayout
from ksi_daemon.providers.base import ProviderCall, ProviderReply
from ksi_daemon.services.consortium.models import ConsortiumDefinition
from ksi_daemon.services.consortium.run import ConsortiumRun, RunParts
from ksi_daemon.services.resilience import CircuitBreaker, RetryPolicy
from ksi_daemon.storage.jsonl.consortia import JsonlTraces
from ksi_daemon.storage.jsonl.responses import JsonlResponses


class Unanswered:
    """A provider whose calls never end: they can only be cancelled."""

    def __init__(self) -> None:
        self.started = 0

    async def complete(self, call: ProviderCall) -> ProviderReply:
        self.started += 1
        await asyncio.Event().wait()
        raise AssertionError("never answered")


class SecondWriteHeld(JsonlResponses):
    """Real response files; the second one written waits until `release` is set."""

    def __init__(self, layout: VarLayout) -> None:
        super().__init__(layout, fsync=False)
        self.release = asyncio.Event()
        self.writes = 0

    async def write(self, response_id: str, lines: list[dict[str, Any]]) -> None:
        self.writes += 1
        if self.writes == 2:
            await self.release.wait()
        await super().write(response_id, lines)


async def test_a_cancelled_run_ends_only_after_every_members_call_is_logged_even_cancelled_twice(tmp_path: Path) -> None:
    layout = VarLayout(tmp_path)
    layout.responses_dir.mkdir(parents=True)
    provider, responses = Unanswered(), SecondWriteHeld(layout)
    parts = RunParts(provider=provider, responses=responses, traces=JsonlTraces(layout, fsync=False),
                     retry=RetryPolicy(attempts=1, base_delay=0.0, max_delay=0.0),
                     breaker=CircuitBreaker(threshold=5, reset=30.0), circuit=lambda model, _options: model,
                     slot=lambda _model: contextlib.nullcontext(), default_timeout=60.0)
    definition = ConsortiumDefinition(members=["openai/ma:2"], arbiter="openai/judge")
    call = ProviderCall(model="consortium/duo", messages=[{"role": "user", "content": "x"}],
                        request={"request_id": "req-1", "conversation_id": "conv-1"})
    run = ConsortiumRun("run-1", "duo", definition, call, parts)
    task = asyncio.create_task(run.execute())
    while provider.started < 2:
        await asyncio.sleep(0)
    task.cancel()
    while responses.writes < 2:  # the first call's log written, the second one's held
        await asyncio.sleep(0.001)
    task.cancel()  # cancelled again (a shutdown after a cancel): the held log must still be awaited
    await asyncio.sleep(0.05)
    assert not task.done(), "the run ended while a member's call log was still being written"
    responses.release.set()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert task.cancelled()
    logged = [orjson.loads(p.read_bytes().splitlines()[-1]) for p in layout.responses_dir.glob("*.jsonl")]
    assert sorted(line["code"] for line in logged) == ["cancelled", "cancelled"]
    trace = [orjson.loads(raw) for raw in (layout.consortium_dir / "run-1.jsonl").read_bytes().splitlines()]
    assert trace[-1]["event"] == "final" and trace[-1]["status"] == "cancelled"
