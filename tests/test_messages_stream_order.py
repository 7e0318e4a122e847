"""The order of a streamed Message's blocks when reasoning does not come as Anthropic sends it:
a signature known only with the result closes the streamed thinking block then; reasoning that
arrives after the answer began comes whole with the result, after it."""

from __future__ import annotations

from typing import Any

from ksi_daemon.transports.http.anthropic.shapes import MessageEvents

SIGNED_ITEM = {"type": "reasoning", "summary": "think",
               "thinking_blocks": [{"type": "thinking", "thinking": "think", "signature": "sig-1"}]}


def result(*output: dict[str, Any]) -> dict[str, Any]:
    return {"response_id": "r1", "content": "hi", "finish_reason": "stop", "usage": {},
            "output": [*output, {"type": "message", "role": "assistant", "content": "hi"}]}


def blocks(events: list[tuple[str, dict[str, Any]]]) -> list[tuple[Any, ...]]:
    """(type, index, delta type) of each block event."""
    return [(kind, data["index"], data.get("delta", data.get("content_block", {})).get("type"))
            for kind, data in events if kind.startswith("content_block")]


def test_a_signature_known_only_with_the_result_closes_the_streamed_block() -> None:
    events = MessageEvents("msg_r1", "m")
    seen = [*events.reasoning({"text": "think"}), *events.done(result(SIGNED_ITEM))]
    assert blocks(seen) == [("content_block_start", 0, "thinking"), ("content_block_delta", 0, "thinking_delta"),
                            ("content_block_delta", 0, "signature_delta"), ("content_block_stop", 0, None),
                            ("content_block_start", 1, "text"), ("content_block_delta", 1, "text_delta"),
                            ("content_block_stop", 1, None)]
    assert seen[2][1]["delta"]["signature"] == "sig-1"


def test_reasoning_after_the_text_began_comes_whole_with_the_result() -> None:
    events = MessageEvents("msg_r1", "m")
    seen = [*events.text("hi"), *events.reasoning({"text": "think"}), *events.done(result(SIGNED_ITEM))]
    assert blocks(seen) == [("content_block_start", 0, "text"), ("content_block_delta", 0, "text_delta"),
                            ("content_block_stop", 0, None), ("content_block_start", 1, "thinking"),
                            ("content_block_delta", 1, "thinking_delta"), ("content_block_delta", 1, "signature_delta"),
                            ("content_block_stop", 1, None)]
    # the text once (not again with the result), the thinking once (not both streamed and whole)
    assert [data["delta"].get("thinking") or data["delta"].get("text") for kind, data in seen
            if kind == "content_block_delta"] == ["hi", "think", None]
