"""Who answers a model: the provider, or an answerer named by the model's prefix (`consortium/`)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from ksi_daemon.providers.base import Provider


@runtime_checkable
class ChecksUpFront(Protocol):
    """An answerer that can refuse a model before the request is queued (an unknown consortium,
    a model name no provider answers to)."""

    async def check(self, model: str, inline: dict[str, Any] | None) -> None: ...


class Answerers:
    """The provider and the answerers by model prefix (e.g. "consortium/": a consortium run)."""

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

    def by_provider(self, model: str) -> bool:
        """Answered by the provider itself (a call that takes a concurrency slot and is calibrated),
        not by an answerer whose own calls do."""
        return self.for_model(model) is self.provider

    async def check_up_front(self, model: str, inline: dict[str, Any] | None) -> None:
        """Answerers that can refuse a model up front (an unknown consortium) fail the ack itself."""
        checker = self._up_front.get(id(self.for_model(model)))
        if checker is not None:
            await checker.check(model, inline)
