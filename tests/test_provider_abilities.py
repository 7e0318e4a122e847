"""What a provider is (keeps its own session, takes a concurrency slot, is calibrated, what each
model takes) is read from the provider, never guessed from a model's name: providers defined
here, under names no built-in provider has, are treated as their attributes say."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from ksi_common.errors import ErrorCode, KsiError
from ksi_daemon.daemon import Daemon
from ksi_daemon.providers.base import ModelAbilities, ProviderCall, ProviderReply
from tests.conftest import complete, connected, make_settings

PROMPT = "Please remember the names of the seven planets I am about to list for you, in their order from the sun."


class NoteKeeper:
    """Keeps its own session, as a CLI does: names it in every reply, and records what it was sent."""

    keeps_session = True
    takes_slot = True
    calibrated = False

    def __init__(self) -> None:
        self.calls: list[ProviderCall] = []

    async def abilities(self, model: str) -> ModelAbilities:
        return ModelAbilities(function_calling=False, vision=False, because="keeps its own notebook")

    async def complete(self, call: ProviderCall) -> ProviderReply:
        self.calls.append(call)
        return ProviderReply(content=f"noted {len(self.calls)}", model=call.model, finish_reason="stop",
                             usage={"prompt_tokens": 400, "completion_tokens": 2, "total_tokens": 402},
                             session_id=call.resume_session or f"notebook-{len(self.calls)}")


class Gate:
    """Answers once its gate is open; `takes_slot` as the test chooses, calibrated."""

    keeps_session = False
    calibrated = True

    def __init__(self, takes_slot: bool, open_: bool = False) -> None:
        self.takes_slot = takes_slot
        self.opened = asyncio.Event()
        if open_:
            self.opened.set()
        self.entered = asyncio.Event()
        self.calls = 0

    async def abilities(self, model: str) -> ModelAbilities:
        return ModelAbilities()

    async def complete(self, call: ProviderCall) -> ProviderReply:
        self.calls += 1
        self.entered.set()
        await self.opened.wait()
        # twice the daemon's count of any prompt of this test: a ratio a calibrated provider teaches
        estimate = sum(len(str(m.get("content", ""))) for m in call.messages) // 4
        return ProviderReply(content="through", model=call.model, finish_reason="stop",
                             usage={"prompt_tokens": 2 * estimate, "completion_tokens": 1})


@asynccontextmanager
async def daemon_with(root: Path, providers: dict[str, Any], **overrides: Any) -> AsyncIterator[Daemon]:
    """A real daemon whose completion path also routes these model prefixes to these providers."""
    daemon = Daemon(make_settings(root, **overrides))
    daemon.completion.admission.answerers.by_prefix.update(providers)
    await daemon.start()
    try:
        yield daemon
    finally:
        await daemon.shutdown()


async def test_a_provider_that_keeps_its_session_is_resumed_as_a_cli_is(short_tmp: Path) -> None:
    keeper = NoteKeeper()
    async with daemon_with(short_tmp, {"notes/": keeper}) as daemon, connected(daemon) as client:
        first = await complete(client, prompt="Alice", model="notes/pad")
        conversation = first["conversation_id"]
        second = await complete(client, prompt="Bob", model="notes/pad", conversation_id=conversation)
        await complete(client, prompt="Carol", model="echo/other", conversation_id=conversation)
        await complete(client, prompt="Dan", model="notes/pad", conversation_id=conversation)
        sent = await client.request("conversation:sent", {"conversation_id": conversation, "n": 2})
        summariser = daemon.completion.compactor.summariser
    # its session is resumed while it answered the previous exchange; after another model, a fresh one
    assert [call.resume_session for call in keeper.calls] == [None, "notebook-1", None]
    assert second["content"] == "noted 2" and sent["resumed_session"] is True
    # it has its own memory: no default summariser writes its conversations' summaries
    assert summariser("notes/pad") is None and summariser("echo/other") == "echo/other"
    # its counts are not of the prompt the daemon built: nothing is learned from them
    assert daemon.completion.calibration.ratio("notes/pad") == 1.0


async def test_what_a_model_cannot_take_is_refused_in_its_providers_words(short_tmp: Path) -> None:
    keeper = NoteKeeper()
    tool = {"type": "function", "name": "weather", "parameters": {"type": "object", "properties": {}}}
    async with daemon_with(short_tmp, {"notes/": keeper}) as daemon, connected(daemon) as client:
        with pytest.raises(KsiError) as caught:
            await client.request("completion:async", {"prompt": "hi", "model": "notes/pad", "tools": [tool]})
        listed = await client.request("conversation:list", {})
    assert caught.value.code == ErrorCode.UNSUPPORTED_PARAMETER
    assert list(caught.value.details["fields"]) == ["tools"]
    assert "keeps its own notebook" in caught.value.message
    assert keeper.calls == [] and listed["total"] == 0  # nothing ran, nothing was written


async def test_a_provider_that_takes_no_slot_never_waits_for_one(short_tmp: Path) -> None:
    gate, runner = Gate(takes_slot=True), Gate(takes_slot=False, open_=True)
    async with daemon_with(short_tmp, {"gate/": gate, "runner/": runner}, max_concurrency=1) as daemon, \
            connected(daemon) as client:
        holding = await client.request("completion:async", {"prompt": PROMPT, "model": "gate/a"})
        await gate.entered.wait()  # the only slot is taken
        waiting = await client.request("completion:async", {"prompt": PROMPT, "model": "gate/b"})
        through = await complete(client, prompt=PROMPT, model="runner/c")
        assert through["content"] == "through"
        # the provider that takes a slot still waits for one: its second call has not been made
        assert gate.calls == 1
        status = await client.request("completion:status", {"request_id": waiting["request_id"]})
        assert status["status"] == "queued"
        gate.opened.set()
        for ack in (holding, waiting):
            done = await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 30})
            assert done["content"] == "through"
        calibration = daemon.completion.calibration
    assert gate.calls == 2
    # a calibrated provider's counts teach the model's ratio
    assert calibration.ratio("gate/a") > 1.0 and calibration.ratio("runner/c") > 1.0
