"""A client's item as KSI keeps it: what a client-held history, or items added to a conversation,
may hold (messages, function calls and their outputs, reasoning), checked and normalised."""

from __future__ import annotations

import re
from typing import Any

from ksi_common import items
from ksi_common.errors import ErrorCode, KsiError

OUTPUT_KINDS = frozenset({"function_call", "reasoning"})
TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # the rule of a tool's name, in `tools` and in a call
CALL_NAME = re.compile(TOOL_NAME)


def _invalid(where: str, why: str) -> KsiError:
    return KsiError(ErrorCode.VALIDATION_ERROR, f"{where}: {why}", fields={where: why})


def _with_breakpoint(item: items.Item, raw: dict[str, Any], where: str) -> items.Item:
    """A user message with the client's own OpenAI prompt-cache breakpoint at its end: a client that
    resends its history marks the prefix it had cached, which is read again only at that breakpoint.
    (Anthropic's cache_control on a resent history is not kept: see docs/messages.md.)"""
    marker = raw.get("prompt_cache_breakpoint")
    if marker is None or item["role"] != "user":
        return item
    if not isinstance(marker, dict):
        raise _invalid(f"{where}.prompt_cache_breakpoint", "must be an object")
    return {**item, "prompt_cache_breakpoint": marker}


def normalised(raw: Any, where: str) -> items.Item:
    if not isinstance(raw, dict):
        raise _invalid(where, "an item must be an object")
    kind = raw.get("type") or "message"
    if kind == "message":
        role = raw.get("role")
        if role == "developer":
            role = "system"
        if role not in ("user", "assistant", "system"):
            raise _invalid(f"{where}.role", "must be user, assistant, system or developer")
        content = raw.get("content")
        if isinstance(content, list):  # text parts read as their text; other parts stay parts
            texts = [p.get("text") for p in content if isinstance(p, dict)
                     and p.get("type") in ("input_text", "output_text", "text")]
            if len(texts) == len(content) and all(isinstance(t, str) for t in texts):
                content = "".join(texts)  # type: ignore[arg-type]
        if not isinstance(content, (str, list)):
            raise _invalid(f"{where}.content", "must be text or a list of parts")
        if role == "user" and not (content.strip() if isinstance(content, str) else content):
            raise _invalid(f"{where}.content", "a user message must not be empty")
        return _with_breakpoint(items.message(role, content), raw, where)
    if kind == "function_call":
        for key in ("call_id", "name"):
            if not isinstance(raw.get(key), str) or not raw.get(key):
                raise _invalid(f"{where}.{key}", "must be a non-empty string")
        if not CALL_NAME.fullmatch(raw["name"]):
            raise _invalid(f"{where}.name", "must be 1 to 64 letters, digits, underscores or hyphens, as a tool's name")
        call = {"type": kind, "call_id": raw["call_id"], "name": raw["name"], "arguments": str(raw.get("arguments") or "")}
        return items.with_client_form(call, raw)
    if kind == "function_call_output":
        if not isinstance(raw.get("call_id"), str) or not raw.get("call_id"):
            raise _invalid(f"{where}.call_id", "must be a non-empty string")
        return items.with_client_form({"type": kind, "call_id": raw["call_id"], "output": str(raw.get("output") or "")}, raw)
    if kind == "reasoning":
        reasoning: items.Item = {"type": kind, "summary": str(raw.get("summary") or "")}
        blocks = raw.get("thinking_blocks")
        if isinstance(blocks, list) and all(isinstance(block, dict) for block in blocks):
            # a provider's own signed blocks (the Messages door's thinking): replayed to it as they came
            reasoning["thinking_blocks"] = [dict(block) for block in blocks]
        return reasoning
    raise _invalid(f"{where}.type", f"{kind} items cannot be part of a history "
                                    "(message, function_call, function_call_output, reasoning)")
