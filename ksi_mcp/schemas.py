"""The tools' names, descriptions, input and output schemas and annotations (kept lean: clients
pay for them in tokens), and the check of a call's arguments, so bad input gets KSI's
`validation_error`."""

from __future__ import annotations

from typing import Any

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.limits import out_of_range

_ID = {"type": "string", "description": "KSI conversation id from an earlier reply"}
_STR = {"type": "string"}
_INT = {"type": "integer"}
_MAYBE_STR = {"type": ["string", "null"]}

# A failed call's structuredContent: KSI's error ({code, message, details}), as every door reports it.
_ERROR = {"type": "object", "required": ["code", "message"]}

# What a turn (chat, consensus, agent_message) returns.
_TURN = {
    "answer": _STR, "continuation_id": _STR, "model": _MAYBE_STR, "response_id": _MAYBE_STR,
    "turns_left": {"type": ["integer", "null"]},
    "left_out": {"type": "object", "properties": {"exchanges": _INT, "files": _INT}},
}


def _output(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    """The structuredContent of a success (`required` present) or of a tool error (`error`)."""
    return {"type": "object", "properties": {**properties, "error": _ERROR},
            "anyOf": [{"required": required}, {"required": ["error"]}]}


def _annotations(*, read_only: bool, calls_a_model: bool) -> dict[str, Any]:
    # No tool deletes or overwrites: a turn appends, a fork makes a new conversation.
    hints: dict[str, Any] = {"destructiveHint": False, "openWorldHint": calls_a_model}
    if read_only:
        hints["readOnlyHint"] = True
    return hints


def _tool(name: str, title: str, description: str, properties: dict[str, Any], required: list[str],
          output: dict[str, Any], *, read_only: bool = False, calls_a_model: bool = False) -> dict[str, Any]:
    schema = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    return {"name": name, "title": title, "description": description, "inputSchema": schema,
            "outputSchema": output,
            "annotations": _annotations(read_only=read_only, calls_a_model=calls_a_model)}


TOOLS: list[dict[str, Any]] = [
    _tool("chat", "Chat with a model", "One turn with a model. Pass continuation_id to continue any KSI "
          "conversation (also from the ksi CLI, HTTP API or agents; kept across restarts). Returns the answer, "
          "continuation_id, turns left and history left out.", {
              "prompt": _STR,
              "model": {"type": "string", "description": "e.g. openai/gpt-4o; default: the conversation's last"},
              "continuation_id": _ID,
              "files": {"type": "array", "items": _STR, "description": "paths to attach"},
              "system": {"type": "string", "description": "system prompt from now on"},
          }, ["prompt"], _output(_TURN, ["answer", "continuation_id"]), calls_a_model=True),
    _tool("consensus", "Ask a consortium", "Ask several models; an arbiter returns synthesis, confidence and "
          "dissent.", {
              "prompt": _STR,
              "consortium": {"type": "string", "description": "a saved consortium's name"},
              "models": {"type": "array", "items": _STR, "description": "or member models; the first also arbitrates"},
              "continuation_id": _ID,
          }, ["prompt"], _output({**_TURN, "confidence": {"type": ["number", "null"]}, "dissent": _STR,
                                  "run_id": _MAYBE_STR}, ["answer", "continuation_id"]), calls_a_model=True),
    _tool("conversations", "Find conversations", "List KSI conversations, newest first: id, title, models, "
          "turns, last activity.", {
              "query": {"type": "string", "description": "a word of the title or content"},
              "status": {"type": "string", "enum": ["active", "archived", "expired"]},
              "limit": {"type": "integer", "minimum": 1, "maximum": 200},
          }, [], _output({"conversations": {"type": "array", "items": {
              "type": "object", "properties": {"continuation_id": _STR}, "required": ["continuation_id"]}},
              "total": _INT}, ["conversations", "total"]), read_only=True),
    _tool("conversation", "Read a conversation", "A conversation's transcript; pin/unpin keep exchanges "
          "verbatim in every turn or stop.", {
        "continuation_id": _ID,
        "format": {"type": "string", "enum": ["markdown", "json"]},
        "pin": {"type": "array", "items": {"type": "integer"}, "description": "exchange numbers to pin"},
        "unpin": {"type": "array", "items": {"type": "integer"}, "description": "exchange numbers to unpin"},
    }, ["continuation_id"], _output({"continuation_id": _STR, "format": _STR, "exchanges": _INT,
                                     "cut": {"type": "boolean"}}, ["continuation_id", "exchanges"])),
    _tool("fork", "Fork a conversation", "A new conversation sharing the first `at` exchanges of another.", {
        "continuation_id": _ID,
        "at": {"type": "integer", "minimum": 0},
    }, ["continuation_id", "at"], _output({"continuation_id": _STR, "parent_id": _STR, "fork_at": _INT},
                                          ["continuation_id", "parent_id", "fork_at"])),
    _tool("agent_message", "Message an agent", "Send a message to a KSI agent and return its reply.", {
        "agent_id": _STR,
        "message": _STR,
    }, ["agent_id", "message"], _output({**_TURN, "agent_id": _STR}, ["answer", "continuation_id", "agent_id"]),
        calls_a_model=True),
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
    too_big = out_of_range(value)  # no event's JSON carries it: refused here, not failed on the way
    if too_big is not None:
        return f"must fit in 64 bits ({too_big})"
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
