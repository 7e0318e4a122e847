"""What the built-in `echo/...` model answers, without litellm: the custom provider litellm calls
(echo.py) and the adapter's answer while litellm is still loading give the same reply."""

from __future__ import annotations

import secrets
from typing import Any

from ksi_daemon.providers.base import ProviderCall, ProviderReply
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


def echo_usage(messages: list[dict[str, Any]], answer: str) -> dict[str, int]:
    prompt = sum(len(_text(m).split()) + 4 for m in messages)
    completion = len(answer.split())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def echo_pieces(answer: str) -> list[str]:
    """The answer as it streams: word by word, each but the last with its space."""
    words = answer.split(" ")
    return [word if position == len(words) - 1 else word + " " for position, word in enumerate(words)]


def answer_without_litellm(call: ProviderCall) -> ProviderReply:
    """The reply litellm would give for an echo call, streamed to `call.on_chunk` when it streams."""
    answer = echo_answer(call.messages)
    if call.on_chunk is not None:
        for piece in echo_pieces(answer):
            call.on_chunk(piece)
    return ProviderReply(content=answer, model=call.model, finish_reason="stop",
                         usage=echo_usage(call.messages, answer), provider="echo",
                         provider_response_id=f"chatcmpl-{secrets.token_hex(16)}")
