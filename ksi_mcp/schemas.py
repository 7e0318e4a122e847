"""The tools' names, descriptions and input schemas (kept lean: clients pay for them in tokens),
and the check of a call's arguments against them, so bad input gets KSI's `validation_error`."""

from __future__ import annotations

from typing import Any

from ksi_common.errors import ErrorCode, KsiError

_ID = {"type": "string", "description": "KSI conversation id from an earlier reply"}


def _tool(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    schema = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    return {"name": name, "description": description, "inputSchema": schema}


TOOLS: list[dict[str, Any]] = [
    _tool("chat", "One turn with a model. Pass continuation_id to continue any KSI conversation "
          "(also from the ksi CLI, HTTP API or agents; kept across restarts). Returns the answer, "
          "continuation_id, turns left and history left out.", {
              "prompt": {"type": "string"},
              "model": {"type": "string", "description": "e.g. openai/gpt-4o; default: the conversation's last"},
              "continuation_id": _ID,
              "files": {"type": "array", "items": {"type": "string"}, "description": "paths to attach"},
              "system": {"type": "string", "description": "system prompt from now on"},
          }, ["prompt"]),
    _tool("consensus", "Ask several models; an arbiter returns synthesis, confidence and dissent.", {
        "prompt": {"type": "string"},
        "consortium": {"type": "string", "description": "a saved consortium's name"},
        "models": {"type": "array", "items": {"type": "string"},
                   "description": "or member models; the first also arbitrates"},
        "continuation_id": _ID,
    }, ["prompt"]),
    _tool("conversations", "List KSI conversations, newest first: id, title, models, turns, last activity.", {
        "query": {"type": "string", "description": "a word of the title or content"},
        "status": {"type": "string", "enum": ["active", "archived", "expired"]},
        "limit": {"type": "integer", "minimum": 1, "maximum": 200},
    }, []),
    _tool("conversation", "A conversation's transcript; pin/unpin keep exchanges verbatim in every turn or stop.", {
        "continuation_id": _ID,
        "format": {"type": "string", "enum": ["markdown", "json"]},
        "pin": {"type": "array", "items": {"type": "integer"}, "description": "exchange numbers to pin"},
        "unpin": {"type": "array", "items": {"type": "integer"}, "description": "exchange numbers to unpin"},
    }, ["continuation_id"]),
    _tool("fork", "A new conversation sharing the first `at` exchanges of another.", {
        "continuation_id": _ID,
        "at": {"type": "integer", "minimum": 0},
    }, ["continuation_id", "at"]),
    _tool("agent_message", "Send a message to a KSI agent and return its reply.", {
        "agent_id": {"type": "string"},
        "message": {"type": "string"},
    }, ["agent_id", "message"]),
]

BY_NAME: dict[str, dict[str, Any]] = {tool["name"]: tool for tool in TOOLS}

_TYPES: dict[str, tuple[type, ...]] = {"string": (str,), "integer": (int,), "array": (list,)}


def _problem(spec: dict[str, Any], value: Any) -> str | None:
    kind = spec["type"]
    if not isinstance(value, _TYPES[kind]) or isinstance(value, bool):
        return f"must be {'an' if kind[0] in 'ai' else 'a'} {kind}"
    item_kind = spec.get("items", {}).get("type", "string")
    if kind == "array" and not all(isinstance(item, _TYPES[item_kind]) and not isinstance(item, bool)
                                   for item in value):
        return f"must be a list of {item_kind}s"
    if "enum" in spec and value not in spec["enum"]:
        return f"must be one of {', '.join(spec['enum'])}"
    if "minimum" in spec and value < spec["minimum"]:
        return f"must be at least {spec['minimum']}"
    if "maximum" in spec and value > spec["maximum"]:
        return f"must be at most {spec['maximum']}"
    if kind == "string" and not value.strip():
        return "must not be empty"
    return None


def checked_arguments(name: str, arguments: dict[str, Any] | None) -> dict[str, Any]:
    """The arguments of a call to tool `name`, or `validation_error` naming every bad field."""
    tool = BY_NAME.get(name)
    if tool is None:
        raise KsiError(ErrorCode.VALIDATION_ERROR, f"unknown tool {name!r}; tools: {', '.join(BY_NAME)}",
                       fields={"name": "unknown tool"})
    schema = tool["inputSchema"]
    arguments = {k: v for k, v in (arguments or {}).items() if v is not None}  # null means absent
    fields: dict[str, str] = {}
    for key in schema["required"]:
        if key not in arguments:
            fields[key] = "required"
    for key, value in arguments.items():
        spec = schema["properties"].get(key)
        problem = "unknown argument" if spec is None else _problem(spec, value)
        if problem:
            fields[key] = problem
    if fields:
        raise KsiError(ErrorCode.VALIDATION_ERROR,
                       f"{name}: " + "; ".join(f"{key} {problem}" for key, problem in fields.items()),
                       fields=fields)
    return arguments
