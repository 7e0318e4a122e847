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

from collections import Counter
from dataclasses import dataclass
from typing import Any

import orjson

from ksi_common.items import Item
from ksi_daemon.providers.tool_calls import CUSTOM_INPUT

INPUT_ARGUMENT = CUSTOM_INPUT  # the one string argument a custom tool becomes
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
    """How one function given to a provider maps back: the client's tool type, its namespace and
    its own name (the provider's name differs only where two namespaces hold the same name)."""

    kind: str  # function, custom, local_shell or shell
    namespace: str | None = None
    name: str = ""


def _entries(tools: list[dict[str, Any]]) -> list[tuple[dict[str, Any], str | None]]:
    """Every tool the client runs, a namespace's in its place, with its namespace."""
    found: list[tuple[dict[str, Any], str | None]] = []
    for tool in tools:
        inner = tool.get("tools") if tool.get("type") == "namespace" else None
        if isinstance(inner, list):
            found.extend((each, str(tool.get("name") or "")) for each in inner if isinstance(each, dict))
        else:
            found.append((tool, None))
    return found


def tool_entries(tools: list[dict[str, Any]]) -> list[tuple[dict[str, Any], tuple[str | None, str]]]:
    """Every tool the client runs (a namespace's in its place) with its (namespace, name), in the
    order `as_functions` gives them."""
    return [(tool, (namespace, _client_name(tool))) for tool, namespace in _entries(tools)]


def _client_name(tool: dict[str, Any]) -> str:
    kind = tool.get("type", "function")
    return kind if kind in SHELL_PARAMETERS else str(tool.get("name") or "")


def provider_names(tools: list[dict[str, Any]]) -> dict[tuple[str | None, str], str]:
    """The function name the provider is given for each (namespace, name): the client's own name,
    unless another tool has it too (two namespaces, or a namespace and a top-level tool): then
    `namespace__name`, so every call still names one tool."""
    entries = [(namespace, _client_name(tool)) for tool, namespace in _entries(tools)]
    counts = Counter(name for _namespace, name in entries)
    return {(namespace, name): name if counts[name] == 1 or namespace is None else f"{namespace}__{name}"[:64]
            for namespace, name in entries}


def catalog(tools: list[dict[str, Any]]) -> dict[str, ToolKind]:
    """Each function name a provider is given, with the client tool it stands for."""
    names = provider_names(tools)
    return {names[(namespace, _client_name(tool))]: ToolKind(tool.get("type", "function"), namespace, _client_name(tool))
            for tool, namespace in _entries(tools)}


def as_functions(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's tools as function tools in the Responses form (a namespace's tools in its place)."""
    names = provider_names(tools)
    return [_as_function(tool, names[(namespace, _client_name(tool))]) for tool, namespace in _entries(tools)]


def _as_function(tool: dict[str, Any], name: str) -> dict[str, Any]:
    kind = tool.get("type", "function")
    if kind == "custom":
        described = tool.get("description") or ""
        grammar = (tool.get("format") or {}).get("definition")
        if grammar:  # the provider cannot be held to it: the model is shown it
            described = f"{described}\n\nThe input follows this grammar:\n{grammar}".strip()
        return {"type": "function", "name": name, "description": described or None, "parameters": CUSTOM_PARAMETERS}
    if kind in SHELL_PARAMETERS:
        return {"type": "function", "name": name, "description": f"run commands ({kind})",
                "parameters": SHELL_PARAMETERS[kind]}
    return tool if tool.get("name") == name else {**tool, "name": name}


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
        client = {"type": "function_call", "name": found.name, "arguments": call.get("arguments") or "{}"}
    elif found.kind == "custom":
        text = arguments.get(INPUT_ARGUMENT) if arguments is not None else None
        # a model that answered with bare text instead of the argument object: that text is the input,
        # and the call is kept with the arguments it stands for (what a resent history reads back)
        text = text if isinstance(text, str) else str(call.get("arguments") or "")
        client = {"type": "custom_tool_call", "name": found.name, "input": text}
        call = {**call, "arguments": orjson.dumps({INPUT_ARGUMENT: text}).decode()}
    else:
        action = dict(arguments or {})
        if found.kind == "local_shell":
            action = {"type": "exec", "env": {}, **action}
        client = {"type": SHELL_CALLS[found.kind], "action": action}
    if found.namespace is not None:
        client["namespace"] = found.namespace
    return {**call, "client_item": {"call_id": call.get("call_id"), **client}}


def function_form(item: dict[str, Any], names: dict[tuple[str | None, str], str] | None = None) -> Item:
    """A call in the client's form (a custom tool, shell or namespaced function call of a history
    the client resends) as the function_call item KSI keeps for it; `names`: the request's
    provider_names, for a namespace's tool whose name another tool has too."""
    kind = item.get("type")
    call_id = str(item.get("call_id") or "")
    client = {key: value for key, value in item.items() if key not in ("id", "status")}
    namespace = item.get("namespace") if isinstance(item.get("namespace"), str) else None
    own = str(item.get("name") or "")
    given = (names or {}).get((namespace, own), own)  # the name the provider was given for it
    if kind == "custom_tool_call":
        name, arguments = given, {INPUT_ARGUMENT: str(item.get("input") or "")}
    elif kind in ("local_shell_call", "shell_call"):
        name = "local_shell" if kind == "local_shell_call" else "shell"
        sent = item.get("action")
        action: dict[str, Any] = sent if isinstance(sent, dict) else {}
        # what the model gave, without what the client adds to the action (its type, empty fields)
        arguments = {key: value for key, value in action.items() if key != "type" and value not in (None, {}, [])}
    else:
        return {"type": "function_call", "call_id": call_id, "name": given,
                "arguments": str(item.get("arguments") or ""), "client_item": client}
    return {"type": "function_call", "call_id": call_id, "name": name,
            "arguments": orjson.dumps(arguments).decode(), "client_item": client}


def streams_as_function(name: str, kinds: dict[str, ToolKind]) -> bool:
    """Whether a call through `name` may be shown piece by piece as a function call: only a plain
    function's can (any other is announced whole, in its client form, when the reply ends)."""
    found = kinds.get(name)
    return found is None or found.kind == "function" and found.namespace is None
