"""KSI results in the Messages API's shapes: the Message object, and the SSE events of a streamed
one in the order the Anthropic SDKs accumulate them. Pure functions of the data; no I/O."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from ksi_common.items import Item, function_calls
from ksi_daemon.providers.tool_calls import replayable_blocks

STOP_REASONS = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens",
                "content_filter": "refusal", "function_call": "tool_use"}
Event = tuple[str, dict[str, Any]]


def stop_reason(result: dict[str, Any]) -> str:
    return STOP_REASONS.get(str(result.get("finish_reason") or "stop"), "end_turn")


def usage(result: dict[str, Any]) -> dict[str, Any]:
    counted = result.get("usage") or {}
    return {"input_tokens": int(counted.get("prompt_tokens") or 0),
            "output_tokens": int(counted.get("completion_tokens") or 0)}


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's JSON arguments as a tool_use block's input (text that is no object: under `_raw`)."""
    try:
        parsed = orjson.loads(arguments or "{}")
    except orjson.JSONDecodeError:
        return {"_raw": arguments}
    return parsed if isinstance(parsed, dict) else {"_raw": arguments}


def tool_use(call: Item) -> dict[str, Any]:
    return {"type": "tool_use", "id": str(call.get("call_id") or ""), "name": str(call.get("name") or ""),
            "input": tool_input(str(call.get("arguments") or ""))}


def thinking(item: Item) -> list[dict[str, Any]]:
    """A reasoning item as thinking blocks: the provider's own (signed, redacted) as they came; a
    summary no provider signed (an OpenAI-style model's reasoning) with an empty signature."""
    signed = replayable_blocks(item)
    if signed:
        return [dict(block) for block in signed]
    return [{"type": "thinking", "thinking": str(item.get("summary") or ""), "signature": ""}]


def content_blocks(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The result's output items as content blocks: thinking, text, then tool_use blocks."""
    output = list(result.get("output") or []) or [{"type": "message", "content": result.get("content") or ""}]
    blocks: list[dict[str, Any]] = []
    has_calls = bool(function_calls(output))
    for item in output:
        kind = item.get("type")
        if kind == "reasoning":
            blocks.extend(thinking(item))
        elif kind == "function_call":
            blocks.append(tool_use(item))
        elif kind == "message" and (item.get("content") or not has_calls):
            blocks.append({"type": "text", "text": str(item.get("content") or "")})
    return blocks


def message_object(result: dict[str, Any], model: str) -> dict[str, Any]:
    """A KSI result as a Message; `model`: the name the client asked for."""
    return {"id": f"msg_{result['response_id']}", "type": "message", "role": "assistant", "model": model,
            "content": content_blocks(result), "stop_reason": stop_reason(result), "stop_sequence": None,
            "usage": usage(result)}


def sse(event: Event) -> bytes:
    kind, data = event
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) + b"\n\n"


@dataclass(slots=True)
class MessageEvents:
    """One streamed Message: blocks opened as their first delta arrives (thinking, text, or each
    call by its index), one open at a time, and what came whole with the result announced at its
    end. Thinking streams as it comes while it comes first, as Anthropic orders it; reasoning that
    arrives once text or a call began (a provider that interleaves) comes whole with the result."""

    message_id: str
    model: str
    blocks: list[str] = field(default_factory=list)  # "thinking:N", "text" or "call:N" by block index
    open: int | None = None
    text_sent: bool = False
    thought: int = 0  # thinking blocks streamed as they came
    signing: bool = False  # the open block is a streamed thinking block awaiting its signature
    late: bool = False  # reasoning came after an answer's block: the rest comes with the result

    def start(self) -> Iterator[Event]:
        yield "message_start", {"message": {
            "id": self.message_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}}}
        yield "ping", {}

    def text(self, delta: str) -> Iterator[Event]:
        if "text" not in self.blocks:
            yield from self._open("text", {"type": "text", "text": ""})
        self.text_sent = True
        yield "content_block_delta", {"index": self.blocks.index("text"),
                                      "delta": {"type": "text_delta", "text": delta}}

    def reasoning(self, piece: dict[str, str]) -> Iterator[Event]:
        """A reasoning piece: text of the thinking block being written (opened by its first
        piece), the signature that ends it, or a redacted block whole."""
        self.late = self.late or any(not key.startswith("thinking:") for key in self.blocks)
        if self.late:
            return
        key = f"thinking:{len(self.blocks)}"
        if piece.get("redacted"):
            self.thought += 1
            yield from self._open(key, {"type": "redacted_thinking", "data": piece["redacted"]})
            return
        if not self.signing:
            self.thought += 1
            yield from self._open(key, {"type": "thinking", "thinking": "", "signature": ""})
            self.signing = True
        if piece.get("text"):
            yield "content_block_delta", {"index": self.open, "delta": {"type": "thinking_delta",
                                                                        "thinking": piece["text"]}}
        if piece.get("signature"):
            yield from self._signed(piece["signature"])

    def call(self, tool_call: dict[str, Any]) -> Iterator[Event]:
        key = f"call:{int(tool_call.get('index') or 0)}"
        if key not in self.blocks:
            yield from self._open(key, {"type": "tool_use", "id": str(tool_call.get("call_id") or ""),
                                        "name": str(tool_call.get("name") or ""), "input": {}})
        piece = str(tool_call.get("arguments") or "")
        if piece:
            yield "content_block_delta", {"index": self.blocks.index(key),
                                          "delta": {"type": "input_json_delta", "partial_json": piece}}

    def done(self, result: dict[str, Any]) -> Iterator[Event]:
        output = list(result.get("output") or [])
        calls = function_calls(output)
        blocks = [block for item in output if item.get("type") == "reasoning" for block in thinking(item)]
        streamed = blocks[:self.thought]
        if self.signing and streamed and streamed[-1].get("signature"):  # known only with the result
            yield from self._signed(str(streamed[-1]["signature"]))
        for block in blocks[self.thought:]:
            yield from self._thinking(block)
        text = str(result.get("content") or "")
        if not self.text_sent and (text or not calls):
            yield from self.text(text)
        for index, made in enumerate(calls):
            if f"call:{index}" not in self.blocks:
                yield from self.call({"index": index, "call_id": made.get("call_id"), "name": made.get("name"),
                                      "arguments": made.get("arguments") or "{}"})
        yield from self._close()
        yield "message_delta", {"delta": {"stop_reason": stop_reason(result), "stop_sequence": None},
                                "usage": usage(result)}
        yield "message_stop", {}

    def _thinking(self, block: dict[str, Any]) -> Iterator[Event]:
        """A thinking block as Anthropic streams it: its text, then its signature; a redacted one whole."""
        key = f"thinking:{len(self.blocks)}"
        if block.get("type") == "redacted_thinking":
            yield from self._open(key, dict(block))
            return
        yield from self._open(key, {"type": "thinking", "thinking": "", "signature": ""})
        index = len(self.blocks) - 1
        yield "content_block_delta", {"index": index, "delta": {"type": "thinking_delta",
                                                                "thinking": str(block.get("thinking") or "")}}
        if block.get("signature"):
            yield "content_block_delta", {"index": index, "delta": {"type": "signature_delta",
                                                                    "signature": str(block["signature"])}}

    def _signed(self, signature: str) -> Iterator[Event]:
        """The open thinking block's signature, which ends it."""
        yield "content_block_delta", {"index": self.open, "delta": {"type": "signature_delta",
                                                                    "signature": signature}}
        yield from self._close()

    def _open(self, key: str, block: dict[str, Any]) -> Iterator[Event]:
        yield from self._close()
        self.blocks.append(key)
        self.open = len(self.blocks) - 1
        yield "content_block_start", {"index": self.open, "content_block": block}

    def _close(self) -> Iterator[Event]:
        if self.open is not None:
            yield "content_block_stop", {"index": self.open}
            self.open = None
        self.signing = False
