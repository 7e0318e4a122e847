"""The built-in `echo/...` model: a litellm custom provider that answers from what it received.

Imported only by litellm_provider after litellm itself is loaded.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from litellm import CustomLLM, ModelResponse
from litellm.types.utils import GenericStreamingChunk, Usage

from ksi_daemon.providers.base import message_text as _text


def echo_answer(messages: list[dict[str, Any]]) -> str:
    """A deterministic reply that shows exactly which history the model was given."""
    users = [_text(m) for m in messages if m.get("role") == "user"]
    systems = sum(1 for m in messages if m.get("role") == "system")
    new_input = users[-1] if users else ""
    earlier = users[:-1]
    lines = [f"You said: {new_input}", f"Messages received: {len(messages)} (system: {systems})"]
    if earlier:
        lines.append("Earlier user inputs: " + " | ".join(earlier))
    else:
        lines.append("Earlier user inputs: none")
    return "\n".join(lines)


def _usage(messages: list[dict[str, Any]], answer: str) -> Usage:
    prompt = sum(len(_text(m).split()) + 4 for m in messages)
    completion = len(answer.split())
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


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
        words = answer.split(" ")
        for position, word in enumerate(words):
            last = position == len(words) - 1
            usage = _usage(messages, answer) if last else None
            yield GenericStreamingChunk(
                text=word if last else word + " ",
                is_finished=last,
                finish_reason="stop" if last else "",
                usage={"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                       "total_tokens": usage.total_tokens} if usage else None,
                index=0,
                tool_use=None,
            )

    def streaming(self, model: str, messages: list, *args: Any, **kwargs: Any) -> Iterator[GenericStreamingChunk]:
        yield from self._chunks(messages)

    async def astreaming(self, model: str, messages: list, *args: Any,
                         **kwargs: Any) -> AsyncIterator[GenericStreamingChunk]:
        for chunk in self._chunks(messages):
            yield chunk
