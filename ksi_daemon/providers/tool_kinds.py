"""The client-run tool kinds of the Responses API on a provider that takes only functions.

A request's tools (see completion:async) are functions, custom tools (free text input), namespaces
(groups of functions and custom tools) and Codex's shell forms (`local_shell`, `shell`). A chat
provider is given each as a function: a function as it is, a custom tool as a function with one
string argument `input`, a namespace's tools under their own names, a shell form as a function of
its name whose arguments are the action. A call the model makes through such a function is kept as
a `function_call` item (so pairing, history and replay treat every call alike) that carries the
call in the client's form under `client_item`: what a door shows and what the client's own history
resends. `client_call` goes one way, `function_form` the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from ksi_common.items import Item

INPUT_ARGUMENT = "input"  # the one string argument a custom tool becomes
CUSTOM_PARAMETERS: dict[str, Any] = {
    "type": "object", "properties": {INPUT_ARGUMENT: {"type": "string", "description": "the tool's free text input"}},
    "required": [INPUT_ARGUMENT], "additionalProperties": False}
# local_shell: one command as argv; shell: several commands, each a line of shell
SHELL_PARAMETERS: dict[str, dict[str, Any]] = {
    "local_shell": {"type": "object", "required": ["command"], "properties": {
        "command": {"type": "array", "items": {"type": "string"}, "description": "the command and its arguments"},
        "working_directory": {"type": "string"}, "timeout_ms": {"type": "integer"}}},
    "shell": {"type": "object", "required": ["commands"], "properties": {
        "commands": {"type": "array", "items": {"type": "string"}, "description": "shell commands, run in order"},
        "timeout_ms": {"type": "integer"}, "max_output_length": {"type": "integer"}}},
}
SHELL_CALLS = {"local_shell": "local_shell_call", "shell": "shell_call"}


@dataclass(frozen=True, slots=True)
class ToolKind:
    """How one function given to a provider maps back: the client's tool type and its namespace."""

    kind: str  # function, custom, local_shell or shell
    namespace: str | None = None


def catalog(tools: list[dict[str, Any]]) -> dict[str, ToolKind]:
    """Each function name a provider is given, with the client tool it stands for."""
    found: dict[str, ToolKind] = {}
    for tool in tools:
        kind = tool.get("type", "function")
        if kind == "namespace":
            for inner in tool.get("tools") or []:
                found[inner["name"]] = ToolKind(inner.get("type", "function"), tool["name"])
        elif kind in SHELL_PARAMETERS:
            found[kind] = ToolKind(kind)
        else:
            found[tool["name"]] = ToolKind(kind)
    return found


def as_functions(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's tools as function tools in the Responses form (a namespace's tools in its place)."""
    functions: list[dict[str, Any]] = []
    for tool in tools:
        kind = tool.get("type", "function")
        if kind == "namespace":
            functions.extend(as_functions(list(tool.get("tools") or [])))
        elif kind == "custom":
            described = tool.get("description") or ""
            grammar = (tool.get("format") or {}).get("definition")
            if grammar:  # the provider cannot be held to it: the model is shown it
                described = f"{described}\n\nThe input follows this grammar:\n{grammar}".strip()
            functions.append({"type": "function", "name": tool["name"], "description": described or None,
                              "parameters": CUSTOM_PARAMETERS})
        elif kind in SHELL_PARAMETERS:
            functions.append({"type": "function", "name": kind, "description": f"run commands ({kind})",
                              "parameters": SHELL_PARAMETERS[kind]})
        else:
            functions.append(tool)
    return functions


def _arguments(text: str) -> dict[str, Any] | None:
    try:
        parsed = orjson.loads(text or "{}")
    except orjson.JSONDecodeError:
        return None
    return parsed if isinstance(parsed, dict) else None


def client_call(call: Item, kinds: dict[str, ToolKind]) -> Item:
    """A function_call item the model made, with its client form when its tool is not a plain function."""
    found = kinds.get(str(call.get("name") or ""))
    if found is None or found.kind == "function" and found.namespace is None:
        return call
    arguments = _arguments(str(call.get("arguments") or ""))
    client: dict[str, Any]
    if found.kind == "function":
        client = {"type": "function_call", "name": call["name"], "arguments": call.get("arguments") or "{}"}
    elif found.kind == "custom":
        text = arguments.get(INPUT_ARGUMENT) if arguments is not None else None
        # a model that answered with bare text instead of the argument object: that text is the input,
        # and the call is kept with the arguments it stands for (what a resent history reads back)
        text = text if isinstance(text, str) else str(call.get("arguments") or "")
        client = {"type": "custom_tool_call", "name": call["name"], "input": text}
        call = {**call, "arguments": orjson.dumps({INPUT_ARGUMENT: text}).decode()}
    else:
        action = dict(arguments or {})
        if found.kind == "local_shell":
            action = {"type": "exec", "env": {}, **action}
        client = {"type": SHELL_CALLS[found.kind], "action": action}
    if found.namespace is not None:
        client["namespace"] = found.namespace
    return {**call, "client_item": {"call_id": call.get("call_id"), **client}}


def function_form(item: dict[str, Any]) -> Item:
    """A call in the client's form (a custom tool, shell or namespaced function call of a history
    the client resends) as the function_call item KSI keeps for it."""
    kind = item.get("type")
    call_id = str(item.get("call_id") or "")
    client = {key: value for key, value in item.items() if key not in ("id", "status")}
    if kind == "custom_tool_call":
        name, arguments = str(item.get("name") or ""), {INPUT_ARGUMENT: str(item.get("input") or "")}
    elif kind in ("local_shell_call", "shell_call"):
        name = "local_shell" if kind == "local_shell_call" else "shell"
        given = item.get("action")
        action: dict[str, Any] = given if isinstance(given, dict) else {}
        # what the model gave, without what the client adds to the action (its type, empty fields)
        arguments = {key: value for key, value in action.items() if key != "type" and value not in (None, {}, [])}
    else:
        return {"type": "function_call", "call_id": call_id, "name": str(item.get("name") or ""),
                "arguments": str(item.get("arguments") or ""), "client_item": client}
    return {"type": "function_call", "call_id": call_id, "name": name,
            "arguments": orjson.dumps(arguments).decode(), "client_item": client}


def streams_as_function(name: str, kinds: dict[str, ToolKind]) -> bool:
    """Whether a call through `name` may be shown piece by piece as a function call: only a plain
    function's can (any other is announced whole, in its client form, when the reply ends)."""
    found = kinds.get(name)
    return found is None or found.kind == "function" and found.namespace is None
