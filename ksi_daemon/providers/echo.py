"""The built-in `echo/...` model: a litellm custom provider that answers from what it received.

Imported only by litellm_provider after litellm itself is loaded.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from litellm import CustomLLM, ModelResponse
from litellm.types.utils import GenericStreamingChunk, Usage

from ksi_daemon.providers.echo_answer import echo_answer, echo_pieces, echo_usage


def _usage(messages: list[dict[str, Any]], answer: str) -> Usage:
    return Usage(**echo_usage(messages, answer))


class EchoLLM(CustomLLM):
    """No network, no key: every call goes through litellm like any other model."""

    def _fill(self, model: str, messages: list, model_response: ModelResponse) -> ModelResponse:
        answer = echo_answer(messages)
        model_response.choices[0].message.content = answer  # type: ignore[union-attr]
        model_response.choices[0].finish_reason = "stop"
        model_response.model = f"echo/{model}"
        model_response.created = int(time.time())
        model_response.usage = _usage(messages, answer)  # type: ignore[attr-defined]
        return model_response

    def completion(self, model: str, messages: list, api_base: str, custom_prompt_dict: dict,
                   model_response: ModelResponse, *args: Any, **kwargs: Any) -> ModelResponse:
        return self._fill(model, messages, model_response)

    async def acompletion(self, model: str, messages: list, api_base: str, custom_prompt_dict: dict,
                          model_response: ModelResponse, *args: Any, **kwargs: Any) -> ModelResponse:
        return self._fill(model, messages, model_response)

    def _chunks(self, messages: list) -> Iterator[GenericStreamingChunk]:
        answer = echo_answer(messages)
        pieces = echo_pieces(answer)
        for position, piece in enumerate(pieces):
            last = position == len(pieces) - 1
            yield GenericStreamingChunk(
                text=piece,
                is_finished=last,
                finish_reason="stop" if last else "",
                usage=echo_usage(messages, answer) if last else None,  # type: ignore[typeddict-item]
                index=0,
                tool_use=None,
            )

    def streaming(self, model: str, messages: list, *args: Any, **kwargs: Any) -> Iterator[GenericStreamingChunk]:
        yield from self._chunks(messages)

    async def astreaming(self, model: str, messages: list, *args: Any,
                         **kwargs: Any) -> AsyncIterator[GenericStreamingChunk]:
        for chunk in self._chunks(messages):
            yield chunk
