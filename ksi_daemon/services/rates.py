"""Per-model rate limits (`requests_per_minute`, `tokens_per_minute` in KSI_MODELS) on every call
to a provider: the calls of every daemon sharing the storage count together (its `CallRates`).

A call the model's minute has no room for is not made: it fails with `rate_limited` and the
seconds until the minute has room, not retried by the daemon (the provider never saw it, and a
retry would only spend the client's time). Tokens are counted as the daemon estimates the prompt
before the call, then as the provider's usage reports them once it answered; a call larger than
the whole minute's tokens goes through alone, so it is not refused for ever.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from ksi_common.errors import ErrorCode
from ksi_common.settings import Settings
from ksi_daemon.providers.base import (
    ModelAbilities,
    Provider,
    ProviderCall,
    ProviderFailure,
    ProviderReply,
    message_text,
)
from ksi_daemon.storage.ports import CallRates


class CheckedProvider(Provider, Protocol):
    """A provider that can also refuse a model up front (the litellm provider)."""

    async def check(self, model: str, inline: dict[str, Any] | None) -> None: ...


class RateLimitedProvider:
    """`inner`, with each call counted against its model's rates first."""

    def __init__(self, inner: CheckedProvider, rates: CallRates, settings: Settings,
                 count_tokens: Callable[[str], int]) -> None:
        self.inner = inner
        self.rates = rates
        self.settings = settings
        self.count_tokens = count_tokens
        # what `inner` is, it still is with rates in front of it
        self.keeps_session = inner.keeps_session
        self.takes_slot = inner.takes_slot
        self.calibrated = inner.calibrated

    async def check(self, model: str, inline: dict[str, Any] | None) -> None:
        await self.inner.check(model, inline)

    async def abilities(self, model: str) -> ModelAbilities:
        return await self.inner.abilities(model)

    async def complete(self, call: ProviderCall) -> ProviderReply:
        model = self.settings.model_settings(call.model)
        per_minute, tokens_per_minute = model.requests_per_minute, model.tokens_per_minute
        if per_minute is None and tokens_per_minute is None:
            return await self.inner.complete(call)
        estimate = sum(self.count_tokens(message_text(m)) for m in call.messages)
        decision = await self.rates.admit(call.model, per_minute, tokens_per_minute, estimate)
        if decision.grant is None:
            raise ProviderFailure(
                ErrorCode.RATE_LIMITED,
                f"{call.model} is at its rate limit ({self._limits(per_minute, tokens_per_minute)} per minute, "
                "over every daemon); retry later", retry_after=decision.retry_after, model=call.model)
        reply = await self.inner.complete(call)
        used = reply.usage.get("total_tokens") or (reply.usage.get("prompt_tokens", 0)
                                                   + reply.usage.get("completion_tokens", 0))
        if tokens_per_minute is not None and used and used != estimate:
            await self.rates.settle(call.model, decision.grant, int(used))
        return reply

    @staticmethod
    def _limits(per_minute: int | None, tokens_per_minute: int | None) -> str:
        parts = [f"{per_minute} calls" if per_minute is not None else "",
                 f"{tokens_per_minute} tokens" if tokens_per_minute is not None else ""]
        return " and ".join(p for p in parts if p)
