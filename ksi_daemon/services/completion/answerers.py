"""Who answers a model: the provider, or an answerer named by the model's prefix (`consortium/`,
a CLI's `claude-cli/`); what the daemon must know of a model's answerer is read from the answerer."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from ksi_daemon.providers.base import ModelAbilities, Provider


@runtime_checkable
class ChecksUpFront(Protocol):
    """An answerer that can refuse a model before the request is queued (an unknown consortium,
    a model name no provider answers to, a CLI whose program is missing)."""

    async def check(self, model: str, inline: dict[str, Any] | None) -> None: ...


class Answerers:
    """The provider and the answerers by model prefix (`consortium/`: a consortium run,
    `claude-cli/`: the claude CLI)."""

    def __init__(self, provider: Provider, by_prefix: dict[str, Provider] | None = None) -> None:
        self.provider = provider
        self.by_prefix = by_prefix or {}
        # found once: an isinstance check against a Protocol costs tens of microseconds per request
        self._up_front = {id(a): a for a in [provider, *self.by_prefix.values()] if isinstance(a, ChecksUpFront)}

    def for_model(self, model: str) -> Provider:
        for prefix, answerer in self.by_prefix.items():
            if model.startswith(prefix):
                return answerer
        return self.provider

    def takes_slot(self, model: str) -> bool:
        """A call of `model` takes a concurrency slot; not one whose answerer's own calls take theirs
        (a consortium run)."""
        return self.for_model(model).takes_slot

    async def abilities(self, model: str) -> ModelAbilities:
        """What `model` can take from a request, as its answerer says."""
        return await self.for_model(model).abilities(model)

    async def check_up_front(self, model: str, inline: dict[str, Any] | None) -> None:
        """Answerers that can refuse a model up front (an unknown consortium, a missing CLI) fail
        the ack itself."""
        checker = self._up_front.get(id(self.for_model(model)))
        if checker is not None:
            await checker.check(model, inline)
