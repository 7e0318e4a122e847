"""Custom tools sent as they are, to a model whose chat API takes them.

OpenAI's chat completions take `{"type": "custom", "custom": {"name", "description", "format"}}`
tools and answer with `{"type": "custom", "custom": {"name", "input"}}` tool calls; litellm passes
both through unchanged for `openai/` models. A model whose settings declare
`supports_custom_tools` is given its custom tools in that form (a grammar the provider can then
hold the model to) and sent its history's custom calls in it. Their calls are kept as a translated
one is (tool_kinds.py), so history, pairing and replay do not depend on how the model was asked.
"""

from __future__ import annotations

from typing import Any

import orjson

from ksi_daemon.providers.tool_calls import CUSTOM_INPUT, chat_tool_choice, chat_tools
from ksi_daemon.providers.tool_kinds import ToolKind, as_functions, catalog, provider_names, tool_entries


def native_chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's tools as chat tools, each custom one in its own form, the others as functions."""
    names = provider_names(tools)
    functions = iter(chat_tools(as_functions(tools)))  # one per entry, in the same order
    out = []
    for tool, name_key in tool_entries(tools):
        function = next(functions)
        if tool.get("type") != "custom":
            out.append(function)
            continue
        custom: dict[str, Any] = {"name": names[name_key]}
        if tool.get("description"):
            custom["description"] = tool["description"]
        if tool.get("format"):
            custom["format"] = tool["format"]
        out.append({"type": "custom", "custom": custom})
    return out


def native_tool_choice(choice: str | dict[str, Any], kinds: dict[str, ToolKind]) -> str | dict[str, Any]:
    """`tool_choice` naming a custom tool in that tool's own form."""
    shown = chat_tool_choice(choice)
    if isinstance(choice, dict) and _is_custom(str(choice.get("name") or ""), kinds):
        return {"type": "custom", "custom": {"name": choice["name"]}}
    return shown


def native_history(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with the assistant's calls of custom tools in their own form (their input as
    given); the same list when there is none."""
    kinds = catalog(tools)
    if not any(_is_custom(_called(call), kinds) for m in messages for call in m.get("tool_calls") or []):
        return messages
    return [{**m, "tool_calls": [_native_call(call) if _is_custom(_called(call), kinds) else call
                                 for call in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]


def _called(call: dict[str, Any]) -> str:
    return str((call.get("function") or {}).get("name") or "")


def _is_custom(name: str, kinds: dict[str, ToolKind]) -> bool:
    found = kinds.get(name)
    return found is not None and found.kind == "custom"


def _native_call(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function") or {}
    try:
        arguments = orjson.loads(function.get("arguments") or "{}")
    except orjson.JSONDecodeError:
        arguments = None
    text = arguments.get(CUSTOM_INPUT) if isinstance(arguments, dict) else None
    return {"id": call.get("id"), "type": "custom",
            "custom": {"name": function.get("name"), "input": text if isinstance(text, str) else ""}}
