"""The shape of a response record (`responses/{response_id}.jsonl`): the one place its lines are
composed from domain values, for every writer of one (a completion, a failure, an appended or an
imported exchange, a consortium member's call).

A record is its input lines (the request's raw input, never the history sent with it), then one
outcome line: the answer (`assistant`) or the failure (`error`). `ksi_common.items` is the codec
between items and the fields of a line; this module puts those fields in a line.
"""

from __future__ import annotations

from typing import Any

from ksi_common.items import MARKER_KEYS, Item, input_line_fields, output_fields

VERSION = 1


def message_line(kind: str, content: Any, ts: str | None, **ids: Any) -> dict[str, Any]:
    """An input line holding one message's text (`kind`: user, feedback or system), then `ids`."""
    return {"v": VERSION, "type": kind, "content": content, "ts": ts, **ids}


def item_line(item: Item, user_type: str, text: str | None, ts: str | None, conversation_id: str) -> dict[str, Any]:
    """The input line storing `item` (a user message is of `user_type`, user or feedback)."""
    return {"v": VERSION, **input_line_fields(item, user_type, text), "ts": ts, "conversation_id": conversation_id}


def request_lines(items: list[Item], *, is_feedback: bool, system: str | None, ts: str,
                  ids: dict[str, Any], metadata: dict[str, Any] | None, files: list[str],
                  images: list[dict[str, Any]], options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """A request's raw inputs as lines: each item, marked with `ids` (request, conversation, then
    agent and sender when set) and the request's metadata; its files on the last user line
    (size and sha256 are added when they are read), its stored images as that line's parts, and a
    new system prompt first."""
    lines = []
    for item in items:
        line: dict[str, Any] = {"v": VERSION}
        if item["type"] == "function_call_output":
            line.update(input_line_fields(item))  # with the client's form of the output, when it has one
        else:
            line.update(type="feedback" if is_feedback and item["role"] == "user" else item["role"],
                        content=item["content"])
            line.update({key: item[key] for key in MARKER_KEYS if key in item})
        line.update(ts=ts, **ids)
        if metadata:
            line["metadata"] = metadata
        if options:  # what the client asked that no provider may take (see options.KEPT_OPTIONS)
            line["options"] = options
        lines.append(line)
    if files:
        for line in reversed(lines):
            if line["type"] in ("user", "feedback"):
                line["files"] = [{"path": path} for path in files]
                break
    if images:  # the parts of the user line: its text, then the images by reference
        for line in reversed(lines):
            if line["type"] in ("user", "feedback"):
                text = [{"type": "input_text", "text": line["content"]}] if line["content"] else []
                line["parts"] = [*text, *images]
                break
    if system is not None:
        lines.insert(0, message_line("system", system, ts, request_id=ids.get("request_id"),
                                     conversation_id=ids.get("conversation_id")))
    return lines


def answer_line(output: list[Item], fields: dict[str, Any]) -> dict[str, Any]:
    """The outcome line of an answer: its output items (as `output_fields` stores them), then `fields`."""
    return {"v": VERSION, "type": "assistant", **output_fields(output), **fields}


def error_line(code: str | None, message: str | None, details: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """The outcome line of a failure: its stable code, message and details, then `fields`."""
    return {"v": VERSION, "type": "error", "code": code, "message": message, "details": details, **fields}
