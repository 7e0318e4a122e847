"""Exchange items in the chat-completions shapes litellm takes and gives: tools and tool_choice,
history as user / assistant `tool_calls` / `tool` messages, and a reply's message (or its stream of
deltas) as output items. litellm translates these shapes for every other provider (Anthropic's
`tool_use` / `tool_result` blocks, Ollama's tool calls)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ksi_common.items import Item, item_text, message, part_text


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
            users.append({"role": "user", "content": chat_content(item.get("content") or "")})
    return [*results, *users]


def output_message(items: Iterable[Item]) -> dict[str, Any]:
    """One exchange's output items as the assistant message (a reasoning summary is not sent back)."""
    text = []
    calls = []
    for item in items:
        kind = item.get("type")
        if kind == "message":
            text.append(str(item.get("content") or ""))
        elif kind == "function_call":
            calls.append({"id": str(item["call_id"]), "type": "function",
                          "function": {"name": str(item["name"]), "arguments": str(item.get("arguments") or "{}")}})
    content = "".join(text)
    if not calls:
        return {"role": "assistant", "content": content}
    return {"role": "assistant", "content": content or None, "tool_calls": calls}


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
    """A litellm reply message as output items: its reasoning summary, its text, its tool calls."""
    items: list[Item] = []
    reasoning = getattr(reply_message, "reasoning_content", None)
    if reasoning:
        items.append({"type": "reasoning", "summary": str(reasoning)})
    text = getattr(reply_message, "content", None) or ""
    calls = getattr(reply_message, "tool_calls", None) or []
    if text or not calls:
        items.append(message("assistant", text))
    for call in calls:
        function = getattr(call, "function", None)
        items.append({"type": "function_call", "call_id": str(getattr(call, "id", "") or ""),
                      "name": str(getattr(function, "name", "") or ""),
                      "arguments": str(getattr(function, "arguments", "") or "{}")})
    return items


class ToolCallDeltas:
    """Tool calls arriving in pieces over a stream: each delta names its call by index; the id and
    name come with its first piece, the arguments in fragments."""

    def __init__(self) -> None:
        self._calls: dict[int, dict[str, str]] = {}

    def __bool__(self) -> bool:
        return bool(self._calls)

    def add(self, deltas: Iterable[Any]) -> list[dict[str, Any]]:
        """Take a chunk's tool-call deltas; returns them as chunk payloads."""
        pieces = []
        for delta in deltas:
            index = int(getattr(delta, "index", 0) or 0)
            call = self._calls.setdefault(index, {"call_id": "", "name": "", "arguments": ""})
            function = getattr(delta, "function", None)
            call_id = getattr(delta, "id", None) or ""
            name = getattr(function, "name", None) or ""
            arguments = getattr(function, "arguments", None) or ""
            call["call_id"] = call["call_id"] or call_id
            call["name"] = call["name"] or name
            call["arguments"] += arguments
            pieces.append({"index": index, "call_id": call["call_id"], "name": call["name"], "arguments": arguments})
        return pieces

    def items(self) -> list[Item]:
        return [{"type": "function_call", "call_id": call["call_id"], "name": call["name"],
                 "arguments": call["arguments"] or "{}"}
                for _index, call in sorted(self._calls.items())]
