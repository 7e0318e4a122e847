"""Exchange items: what one exchange took in and gave out, in the Responses API's item model.

An exchange is an ordered list of input items and an ordered list of output items. An item is a
plain dict (it is stored, exported and sent as JSON as it is):

- ``{"type": "message", "role": "user" | "system" | "assistant", "content": str | [part, ...]}``
  where a part is ``{"type": "input_text", "text": str}``, ``{"type": "input_image", "image": ref}``
  or ``{"type": "input_file", "file": ref}``; ``ref`` names stored bytes
  (``{"sha256", "media_type", "bytes"}``, plus ``"url"`` for an image kept as its https URL,
  ``"detail"`` and ``"name"`` where given). An assistant message's content is its text.
- ``{"type": "function_call", "call_id": str, "name": str, "arguments": str}`` (arguments: JSON text)
- ``{"type": "function_call_output", "call_id": str, "output": str}``
- ``{"type": "reasoning", "summary": str}`` (a provider's reasoning summary, when it returns one)

In a response record these are lines (see ``ksi_common.records``), and records written before
items existed read as one user message and one assistant message:

- an input line ``{"type": "user" | "feedback" | "system", "content": str}`` is a message; a user
  line with images or files keeps their parts in ``"parts"`` (``content`` stays its text, so every
  reader can show something);
- an input line ``{"type": "function_call_output", "call_id", "output"}`` is that item;
- the outcome line ``{"type": "assistant", "content": str}`` is one assistant message; when the
  reply holds more than its text (tool calls, a reasoning summary) the line adds ``"output"``: the
  output items in order, the text among them as an assistant message.

This module is the one place that knows how items sit in record lines, and the one that knows
their canonical form: what an exchange's chained digest covers (`exchange_digest`), so a history a
client resends, with its whitespace or its JSON keys in another order, is recognised.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

Item = dict[str, Any]

INPUT_LINE_TYPES = frozenset({"user", "system", "feedback", "function_call_output"})


def message(role: str, content: str | list[dict[str, Any]]) -> Item:
    return {"type": "message", "role": role, "content": content}


def input_items(lines: list[dict[str, Any]]) -> list[Item]:
    """A record's input lines as items (system lines included: callers that keep the system prompt
    elsewhere drop them)."""
    items: list[Item] = []
    for line in lines:
        kind = line.get("type")
        if kind == "function_call_output":
            items.append({"type": "function_call_output", "call_id": str(line.get("call_id") or ""),
                          "output": str(line.get("output") or "")})
        elif kind in ("user", "feedback", "system"):
            parts = line.get("parts")
            role = "system" if kind == "system" else "user"
            items.append(message(role, list(parts) if isinstance(parts, list) else str(line.get("content") or "")))
    return items


def output_items(outcome: dict[str, Any] | None) -> list[Item]:
    """The output items of a record's outcome line (none for a failure or a missing outcome)."""
    if outcome is None or outcome.get("type") != "assistant":
        return []
    stored = outcome.get("output")
    if isinstance(stored, list):
        return [dict(item) for item in stored if isinstance(item, dict)]
    return [message("assistant", str(outcome.get("content") or ""))]


def output_fields(output: list[Item]) -> dict[str, Any]:
    """The fields an outcome line gets for `output`: its text as ``content``, and the items
    themselves only when they hold more than one assistant message."""
    text = output_text(output)
    if len(output) == 1 and output[0].get("type") == "message":
        return {"content": text}
    return {"content": text, "output": output}


def output_text(output: list[Item]) -> str:
    """The assistant's text among output items (empty when it only called tools)."""
    return "".join(str(item.get("content") or "") for item in output
                   if item.get("type") == "message" and isinstance(item.get("content"), str))


def function_calls(output: list[Item]) -> list[Item]:
    return [item for item in output if item.get("type") == "function_call"]


def call_ids_answered(inputs: list[Item]) -> list[str]:
    return [str(item["call_id"]) for item in inputs if item.get("type") == "function_call_output"]


def part_text(content: str | list[dict[str, Any]]) -> str:
    """A message's text: its text parts joined, images and files named by reference."""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        kind = part.get("type")
        if kind == "input_text":
            texts.append(str(part.get("text") or ""))
        elif kind in ("input_image", "input_file"):
            ref = part.get("image") or part.get("file") or {}
            label = ref.get("url") or ref.get("name") or f"sha256:{str(ref.get('sha256') or '')[:12]}"
            texts.append(f"[{'image' if kind == 'input_image' else 'file'} {label}]")
    return " ".join(texts)


def item_text(item: Item) -> str:
    """One line of plain text for an item: what a transcript, a summariser or a token count sees."""
    kind = item.get("type")
    if kind == "message":
        return part_text(item.get("content") or "")
    if kind == "function_call":
        return f"[call {item.get('name')}({item.get('arguments') or ''}) id={item.get('call_id')}]"
    if kind == "function_call_output":
        return f"[output of {item.get('call_id')}: {item.get('output') or ''}]"
    if kind == "reasoning":
        return f"[reasoning: {item.get('summary') or ''}]"
    return ""


# -- the chained digest: what makes a client-held history findable ------------------------------
# An exchange's digest covers the digest before it, the system prompt in effect for it and its
# input and output items in a canonical form: text with its whitespace collapsed, JSON arguments
# re-dumped with sorted keys, item keys sorted. A reasoning summary is left out (clients drop or
# keep it at will), and so are system messages among the inputs (the system prompt is its own
# part of the digest).

def canonical_text(text: str) -> str:
    return " ".join(text.split())


def _canonical_arguments(arguments: str) -> str:
    try:
        parsed = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return canonical_text(arguments)
    return orjson.dumps(parsed, option=orjson.OPT_SORT_KEYS).decode()


def _canonical_content(content: Any) -> Any:
    if isinstance(content, str):
        return canonical_text(content)
    parts = []
    for part in content if isinstance(content, list) else []:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            parts.append(canonical_text(str(part.get("text") or "")))
        elif kind in ("input_image", "input_file"):
            ref = part.get("image") or part.get("file") or {}
            parts.append({"type": kind, "ref": ref.get("sha256") or ref.get("url") or ref.get("name")})
    if all(isinstance(p, str) for p in parts):  # text parts alone read as their text
        return canonical_text(" ".join(parts))
    return parts


def canonical_item(item: Item) -> Item | None:
    """The form of an item its digest covers (None: the digest leaves it out)."""
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant"):
            return None
        return {"type": "message", "role": role, "content": _canonical_content(item.get("content") or "")}
    if kind == "function_call":
        return {"type": kind, "call_id": str(item.get("call_id") or ""), "name": str(item.get("name") or ""),
                "arguments": _canonical_arguments(str(item.get("arguments") or ""))}
    if kind == "function_call_output":
        return {"type": kind, "call_id": str(item.get("call_id") or ""),
                "output": canonical_text(str(item.get("output") or ""))}
    return None


def exchange_digest(previous: str | None, system: str | None, inputs: list[Item], outputs: list[Item]) -> str:
    """d_n = H(d_{n-1}, system in effect at n, canonical input and output items of n), hex."""
    body = [previous or "", canonical_text(system) if system else "",
            [c for c in map(canonical_item, inputs) if c is not None],
            [c for c in map(canonical_item, outputs) if c is not None]]
    return hashlib.sha256(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)).hexdigest()


def digest_chain(system: str | None, exchanges: list[tuple[list[Item], list[Item]]],
                 previous: str | None = None) -> list[str]:
    """The digests of consecutive exchanges under one system prompt, after `previous`."""
    chain = []
    for inputs, outputs in exchanges:
        previous = exchange_digest(previous, system, inputs, outputs)
        chain.append(previous)
    return chain
