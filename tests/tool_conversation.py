"""A tool-using conversation as an export document, for the tests of every door that shows one:
a call and its output, a reasoning summary, an image by reference."""

from __future__ import annotations

import hashlib
from typing import Any

from ksi_daemon.daemon import Daemon
from tests.image_bytes import png

IMAGE_BYTES = png(64, 48, shade=31).ljust(3072, b"\0")  # 3 KB, as the reference says
IMAGE_SHA = hashlib.sha256(IMAGE_BYTES).hexdigest()
TS = "2026-01-02T03:04:05Z"


def tool_exchanges() -> list[dict[str, Any]]:
    """Three exchanges: the model calls a tool; the tool's output comes back and is answered; a
    picture is asked about (after a summary of the model's reasoning)."""
    reply = {"model": "openai/stub-a", "usage": {"prompt_tokens": 10, "completion_tokens": 5}, "ts": TS}
    return [
        {"ts": TS, "model": "openai/stub-a",
         "input": [{"type": "message", "role": "user", "content": "What is the weather in Oslo?"}],
         "output": [{"type": "message", "role": "assistant", "content": "Let me check."},
                    {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Oslo"}'}],
         "reply": {**reply, "content": "Let me check.", "finish_reason": "tool_calls"}},
        {"ts": TS, "model": "openai/stub-a",
         "input": [{"type": "function_call_output", "call_id": "c1", "output": "12C"}],
         "output": [{"type": "message", "role": "assistant", "content": "It is 12C in Oslo."}],
         "reply": {**reply, "content": "It is 12C in Oslo.", "finish_reason": "stop"}},
        {"ts": TS, "model": "openai/stub-a",
         "input": [{"type": "message", "role": "user", "content": [
             {"type": "input_text", "text": "And what is in this picture?"},
             {"type": "input_image", "image": {"sha256": IMAGE_SHA, "media_type": "image/png", "bytes": 3072}}]}],
         "output": [{"type": "reasoning", "summary": "looked at the whiskers"},
                    {"type": "message", "role": "assistant", "content": "A cat."}],
         "reply": {**reply, "content": "A cat.", "finish_reason": "stop"}},
    ]


def tool_document(*exchanges: dict[str, Any], title: str = "Tools") -> dict[str, Any]:
    return {"v": 1, "format": "ksi.conversation", "conversation": {"conversation_id": "elsewhere", "title": title},
            "exchanges": list(exchanges) or tool_exchanges()}


async def store_image(daemon: Daemon) -> None:
    """The picture's bytes in the daemon's blob store: an export names them, never carries them, so
    an import is refused unless they are stored where it is imported."""
    await daemon.storage.blobs.put(IMAGE_BYTES, "image/png")
