"""Exchange items in the chat-completions shapes litellm takes and gives: tools and tool_choice,
history as user / assistant `tool_calls` / `tool` messages, and a reply's message (or its stream of
deltas) as output items. litellm translates these shapes for every other provider (Anthropic's
`tool_use` / `tool_result` blocks, Ollama's tool calls)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import orjson

from ksi_common.items import ABANDONED_ARGUMENTS, MARKER_KEYS, Item, item_text, message, part_text
from ksi_daemon.providers.base import ReasoningPiece

CUSTOM_INPUT = "input"  # the one string argument a custom tool's call is kept with (see tool_kinds.py)


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Function tools in the Responses form as chat-completions tools."""
    out = []
    for tool in tools:
        function: dict[str, Any] = {"name": tool["name"], "parameters": tool.get("parameters") or {}}
        if tool.get("description"):
            function["description"] = tool["description"]
        if tool.get("strict") is not None:
            function["strict"] = tool["strict"]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    return {"type": "function", "function": {"name": choice["name"]}}


def chat_content(content: str | list[dict[str, Any]]) -> str:
    """A message's content as chat text (parts other than text are named by reference)."""
    return part_text(content)


def input_messages(items: Iterable[Item]) -> list[dict[str, Any]]:
    """One exchange's input items as chat messages: the outputs of the calls first (they must follow
    the assistant message that made the calls), then its user messages."""
    results: list[dict[str, Any]] = []
    users: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type")
        if kind == "function_call_output":
            results.append({"role": "tool", "tool_call_id": str(item["call_id"]), "content": str(item.get("output") or "")})
        elif kind == "message" and item.get("role") != "system":
            user = {"role": "user", "content": chat_content(item.get("content") or "")}
            # a client's breakpoint; the provider adapter sends it where it is taken
            user.update({key: item[key] for key in MARKER_KEYS if key in item})
            users.append(user)
    return [*results, *users]


def replayable_blocks(item: Item) -> list[dict[str, Any]]:
    """A reasoning item's thinking blocks that a provider can be sent back: signed ones, redacted ones."""
    blocks = item.get("thinking_blocks")
    return [block for block in blocks if isinstance(block, dict)
            and (block.get("signature") or block.get("type") == "redacted_thinking")] if isinstance(blocks, list) else []


def output_message(items: Iterable[Item]) -> dict[str, Any]:
    """One exchange's output items as the assistant message. Reasoning goes with it only as signed
    thinking blocks (`thinking_blocks`, which litellm gives Anthropic as they came); the provider
    adapter takes them out for a provider that cannot take them back (see without_reasoning)."""
    text = []
    calls = []
    thinking: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type")
        if kind == "reasoning":
            thinking.extend(replayable_blocks(item))
        elif kind == "message":
            text.append(str(item.get("content") or ""))
        elif kind == "function_call":
            calls.append({"id": str(item["call_id"]), "type": "function",
                          "function": {"name": str(item["name"]), "arguments": str(item.get("arguments") or "{}")}})
    content = "".join(text)
    shown: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        shown.update(content=content or None, tool_calls=calls)
    if thinking:
        shown["thinking_blocks"] = thinking
    return shown


REASONING_KEYS = ("thinking_blocks",)


def without_reasoning(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` without the reasoning replayed on assistant messages (the same list when there is none)."""
    if not any(key in message for message in messages for key in REASONING_KEYS):
        return messages
    return [{key: value for key, value in message.items() if key not in REASONING_KEYS}
            if any(key in message for key in REASONING_KEYS) else message for message in messages]


def with_abandoned_arguments(messages: list[dict[str, Any]], abandoned: set[str]) -> list[dict[str, Any]]:
    """`messages` in which the calls of ids `abandoned` carry `ABANDONED_ARGUMENTS`: a call the
    client gave up (its arguments too big for the window, say) is sent small, and its arguments
    stay stored as the model gave them."""
    if not abandoned:
        return messages
    return [{**message, "tool_calls": [
        {**call, "function": {**call["function"], "arguments": ABANDONED_ARGUMENTS}} if call["id"] in abandoned
        else call for call in message["tool_calls"]]} if message.get("tool_calls") else message
        for message in messages]


def with_calls_answered(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` in which every assistant `tool_calls` is followed by a tool message for each call
    and every tool message answers a call just made. Where history broke a pair (a pinned exchange
    shown without its partner, a lost record), both sides are shown as plain text instead, since
    providers refuse a call without its result and a result without its call."""
    if not any("tool_calls" in m or m.get("role") == "tool" for m in messages):
        return messages  # most conversations: no tool turn to look at
    out: list[dict[str, Any]] = []
    position = 0
    while position < len(messages):
        current = messages[position]
        position += 1
        if current.get("role") == "tool":
            out.append(_tool_as_text(current))  # no call just before it
            continue
        calls = current.get("tool_calls") if current.get("role") == "assistant" else None
        if not calls:
            out.append(current)
            continue
        results = []
        while position < len(messages) and messages[position].get("role") == "tool":
            results.append(messages[position])
            position += 1
        made = {call["id"] for call in calls}
        answered = {result["tool_call_id"] for result in results}
        if made <= answered:
            out.append(current)
            out.extend(result for result in results if result["tool_call_id"] in made)
            out.extend(_tool_as_text(result) for result in results if result["tool_call_id"] not in made)
            continue
        shown = " ".join(f"[call {c['function']['name']}({c['function']['arguments']}) id={c['id']}]" for c in calls)
        out.append({"role": "assistant", "content": " ".join(filter(None, [current.get("content"), shown]))})
        out.extend(_tool_as_text(result) for result in results)
    return out


def _tool_as_text(result: dict[str, Any]) -> dict[str, Any]:
    return {"role": "user", "content": item_text({"type": "function_call_output", "call_id": result.get("tool_call_id"),
                                                  "output": result.get("content")})}


def reply_items(reply_message: Any) -> list[Item]:
    """A litellm reply message as output items: its reasoning (its text, and the provider's own
    thinking blocks, signatures and all, when it gave them), its text, its tool calls."""
    items: list[Item] = []
    reasoning = reasoning_item(getattr(reply_message, "reasoning_content", None),
                               getattr(reply_message, "thinking_blocks", None))
    if reasoning is not None:
        items.append(reasoning)
    text = getattr(reply_message, "content", None) or ""
    calls = getattr(reply_message, "tool_calls", None) or []
    if text or not calls:
        items.append(message("assistant", text))
    for call in calls:
        function = getattr(call, "function", None)
        custom = _field(call, "custom")
        if custom is not None:  # a custom tool's call, given as sent (native_tools.py): its one argument
            items.append({"type": "function_call", "call_id": str(getattr(call, "id", "") or ""),
                          "name": str(_field(custom, "name") or ""),
                          "arguments": orjson.dumps({CUSTOM_INPUT: str(_field(custom, "input") or "")}).decode()})
            continue
        items.append({"type": "function_call", "call_id": str(getattr(call, "id", "") or ""),
                      "name": str(getattr(function, "name", "") or ""),
                      "arguments": str(getattr(function, "arguments", "") or "{}")})
    return items


def _field(value: Any, name: str) -> Any:
    """A field of a litellm object or of the plain dict it left a shape it does not know as."""
    return value.get(name) if isinstance(value, dict) else getattr(value, name, None)


def reasoning_item(text: Any, blocks: Any) -> Item | None:
    """The reasoning item of a reply (None when the provider returned no reasoning)."""
    kept = [dict(block) for block in blocks if isinstance(block, dict)] if isinstance(blocks, list) else []
    if not text and not kept:
        return None
    item: Item = {"type": "reasoning", "summary": str(text or "".join(str(b.get("thinking") or "") for b in kept))}
    if kept:
        item["thinking_blocks"] = kept
    return item


class ReasoningDeltas:
    """A reply's reasoning arriving in pieces over a stream: its text, and thinking blocks as text
    pieces followed by the block's signature (a redacted block comes whole)."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.blocks: list[dict[str, Any]] = []

    def add(self, delta: Any) -> list[ReasoningPiece]:
        """Take a chunk's reasoning; returns it as pieces to stream. A thinking block's pieces
        carry the same text as `reasoning_content` beside them: it is streamed once, from them."""
        text = getattr(delta, "reasoning_content", None)
        if text:
            self.text.append(str(text))
        pieces = []
        for piece in getattr(delta, "thinking_blocks", None) or []:
            if not isinstance(piece, dict):
                continue
            if piece.get("type") != "thinking":
                self.blocks.append(dict(piece))
                pieces.append(ReasoningPiece(redacted=str(piece.get("data") or "")))
                continue
            last = self.blocks[-1] if self.blocks else None
            if last is None or last.get("type") != "thinking" or last.get("signature"):
                last = {"type": "thinking", "thinking": ""}
                self.blocks.append(last)
            last["thinking"] += str(piece.get("thinking") or "")
            if piece.get("signature"):
                last["signature"] = piece["signature"]
            pieces.append(ReasoningPiece(text=str(piece.get("thinking") or ""),
                                         signature=str(piece.get("signature") or "")))
        if not pieces and text:
            pieces.append(ReasoningPiece(text=str(text)))
        return [piece for piece in pieces if piece.payload()]

    def item(self) -> Item | None:
        return reasoning_item("".join(self.text), self.blocks)


class ToolCallDeltas:
    """Tool calls arriving in pieces over a stream: each delta names its call by index; the id and
    name come with its first piece, the arguments in fragments."""

    def __init__(self) -> None:
        self._calls: dict[int, dict[str, str]] = {}
        self._custom: set[int] = set()  # the calls of custom tools, their arguments the input text

    def __bool__(self) -> bool:
        return bool(self._calls)

    def add(self, deltas: Iterable[Any]) -> list[dict[str, Any]]:
        """Take a chunk's tool-call deltas; returns them as chunk payloads."""
        pieces = []
        for delta in deltas:
            index = int(getattr(delta, "index", 0) or 0)
            call = self._calls.setdefault(index, {"call_id": "", "name": "", "arguments": ""})
            function = getattr(delta, "function", None)
            custom = _field(delta, "custom")
            if custom is not None:  # a custom tool's call: its free text input arrives in pieces
                self._custom.add(index)
                function = None
            call_id = getattr(delta, "id", None) or ""
            name = _field(custom, "name") if custom is not None else getattr(function, "name", None)
            name = name or ""
            arguments = (_field(custom, "input") if custom is not None else getattr(function, "arguments", None)) or ""
            call["call_id"] = call["call_id"] or call_id
            call["name"] = call["name"] or name
            call["arguments"] += arguments
            pieces.append({"index": index, "call_id": call["call_id"], "name": call["name"], "arguments": arguments})
        return pieces

    def items(self) -> list[Item]:
        return [{"type": "function_call", "call_id": call["call_id"], "name": call["name"],
                 "arguments": orjson.dumps({CUSTOM_INPUT: call["arguments"]}).decode() if index in self._custom
                 else call["arguments"] or "{}"}
                for index, call in sorted(self._calls.items())]
