"""KSI results and records in OpenAI's shapes: output and input items, chat completions and
conversation items (the Response object is response_object.py's). Pure functions of the data; no I/O."""

from __future__ import annotations

import re
import time
from typing import Any

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.items import input_items as stored_input_items
from ksi_common.items import ref_public
from ksi_common.timefmt import parse_ts
from ksi_common.transcripts import exchange_items


def _epoch(ts: Any, default: float | None = None) -> int:
    if isinstance(ts, str):
        try:
            return int(parse_ts(ts))
        except ValueError:
            pass
    return int(default if default is not None else time.time())


# an output item's id as this door gives it: msg_R (msg_R_N for a later message), fc_R_N, rs_R or
# rs_R_N, where R is a KSI response id (a model slug, a dash and 12 hex digits: see ksi_common.ids)
_OUTPUT_ITEM_ID = re.compile(r"(?:msg|fc|rs)_([A-Za-z0-9][A-Za-z0-9_-]*?-[0-9a-f]{12})(?:_[0-9]+)?")


def output_item_response(item_id: str | None) -> str | None:
    """The KSI response an output item's id names, when this door gave the id (else None)."""
    match = _OUTPUT_ITEM_ID.fullmatch(item_id) if item_id else None
    return match.group(1) if match else None


# an item id this door gives, read back: msg_R, msg_R_N, fc_R_N, rs_R, rs_R_N (output items) and
# msg_R_inN, fco_R_inN (a response's input items)
_ITEM_ID = re.compile(r"(msg|fc|rs|fco)_([A-Za-z0-9][A-Za-z0-9_-]*?-[0-9a-f]{12})(?:_(in)?([0-9]+))?")
_KINDS = {"msg": "message", "fc": "function_call", "rs": "reasoning", "fco": "function_call_output"}


def item_reference(item_id: str, where: str) -> dict[str, Any]:
    """An `item_reference` as completion:async takes it: the stored item its id names (the KSI
    response, input or output side, kind, and number); an id this door never gives names no item."""
    match = _ITEM_ID.fullmatch(item_id)
    if match is None or (match.group(1) == "fco") != bool(match.group(3)):
        raise KsiError(ErrorCode.ITEM_NOT_FOUND, f"{where}: no stored item {item_id!r} (KSI's item ids name the "
                       "response that holds them, as its answers give them)", fields={where: "no such item"},
                       item_id=item_id)
    number = match.group(4)
    return {"type": "item_reference", "id": item_id, "response_id": match.group(2),
            "side": "input" if match.group(3) else "output", "kind": _KINDS[match.group(1)],
            "number": int(number) if number is not None else None}


def message_item(response_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [output_text(text)] if text or status == "completed" else []  # a partial answer shows its text
    return {"type": "message", "id": f"msg_{response_id}", "status": status, "role": "assistant", "content": content}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def input_items(response_id: str, inputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's own input lines as input items (messages, tool outputs), oldest first."""
    return [_input_item(item, response_id, position) for position, item in enumerate(stored_input_items(inputs))]


PINS_KEY = "ksi_pins"  # a metadata field: the pinned exchanges' numbers, comma-separated


def pins_field(value: str) -> set[int]:
    """The exchange numbers of a `ksi_pins` metadata value ("" unpins all)."""
    parts = [part.strip() for part in value.split(",") if part.strip()]
    if not all(part.isdigit() and int(part) > 0 for part in parts):
        raise KsiError(ErrorCode.VALIDATION_ERROR, f"{PINS_KEY} must be exchange numbers separated by commas",
                       fields={f"metadata.{PINS_KEY}": "exchange numbers separated by commas, e.g. 1,4"})
    return {int(part) for part in parts}


def conversation_object(conversation: dict[str, Any]) -> dict[str, Any]:
    """A KSI conversation summary as a Conversation object (its pins as a metadata field)."""
    metadata = dict(conversation.get("metadata") or {})
    if conversation.get("pins"):
        metadata[PINS_KEY] = ",".join(str(n) for n in conversation["pins"])
    return {"id": conversation["conversation_id"], "object": "conversation",
            "created_at": _epoch(conversation.get("created")), "metadata": metadata}


def _content_part(part: dict[str, Any]) -> dict[str, Any]:
    """A stored message part as a Conversations item's content part; an image or file by reference
    (its URL, else `sha256:HEX` as its file id), never its bytes."""
    kind = part.get("type")
    if kind in ("input_image", "input_file"):
        ref = ref_public(part.get("image") or part.get("file"))
        shaped: dict[str, Any] = {"type": kind, "file_id": f"sha256:{ref['sha256']}" if ref.get("sha256") else None}
        if kind == "input_image":
            shaped.update(image_url=ref.get("url"), detail=ref.get("detail") or "auto")
        else:
            shaped.update(filename=ref.get("name"))
        return shaped
    return {"type": "input_text", "text": str(part.get("text") or "")}


def _input_item(item: dict[str, Any], response_id: str, position: int) -> dict[str, Any]:
    if item.get("type") == "function_call_output":  # in the client's form when it sent another (a custom tool's)
        output = item.get("client_output") if item.get("client_output") is not None else str(item.get("output") or "")
        return {"type": item.get("client_type") or "function_call_output", "id": f"fco_{response_id}_in{position}",
                "status": "completed", "call_id": item.get("call_id"), "output": output}
    content = item.get("content")
    parts = [_content_part(part) for part in content] if isinstance(content, list) else [
        {"type": "input_text", "text": str(content or "")}]
    return {"type": "message", "id": f"msg_{response_id}_in{position}", "status": "completed",
            "role": "system" if item.get("role") == "system" else "user", "content": parts}


def _output_item(item: dict[str, Any], response_id: str, position: int) -> dict[str, Any]:
    kind = item.get("type")
    if kind == "function_call":
        shown = {"id": f"fc_{response_id}_{position}", "status": "completed", "call_id": item.get("call_id")}
        if isinstance(item.get("client_item"), dict):  # a custom tool's or a shell call, as the client knows it
            return {**item["client_item"], **shown}
        return {"type": "function_call", **shown, "name": item.get("name"), "arguments": item.get("arguments")}
    if kind == "reasoning":
        return {"type": "reasoning", "id": f"rs_{response_id}_{position}",
                "summary": [{"type": "summary_text", "text": str(item.get("summary") or "")}]}
    return message_item(response_id if position == 0 else f"{response_id}_{position}", str(item.get("content") or ""))


def conversation_items(conversation_id: str, exchanges: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each exchange as its input items then its output items (tool calls and their outputs, a
    reasoning summary, images by reference among them), oldest first."""
    items: list[dict[str, Any]] = []
    for exchange in exchanges:
        response_id = exchange.get("response_id") or f"{conversation_id}-{exchange.get('n')}"
        _lines, inputs, output = exchange_items(exchange)
        items += [_input_item(item, response_id, position) for position, item in enumerate(inputs)]
        if isinstance(exchange.get("reply"), dict):
            items += [_output_item(item, response_id, position) for position, item in enumerate(output)]
    return items


def pending_items(conversation: dict[str, Any]) -> list[dict[str, Any]]:
    """A conversation's pending input (user messages and call outputs with no reply yet) as items."""
    shaped = []
    for item in conversation.get("pending_input") or []:
        held = item.get("item")
        if isinstance(held, dict) and held.get("type") == "function_call_output":
            shaped.append({"type": "function_call_output", "id": f"fco_{item['id']}", "status": "completed",
                           "call_id": held.get("call_id"), "output": str(held.get("output") or "")})
            continue
        shaped.append({"type": "message", "id": f"msg_{item['id']}", "status": "completed", "role": "user",
                       "content": [{"type": "input_text", "text": str(item.get("content") or "")}]})
    return shaped


def chat_completion(result: dict[str, Any], created: int) -> dict[str, Any]:
    usage = result.get("usage") or {}
    return {
        "id": f"chatcmpl-{result['response_id']}", "object": "chat.completion", "created": created,
        "model": result["model"],
        "choices": [{"index": 0, "message": {"role": "assistant", "content": result["content"]},
                     "finish_reason": result.get("finish_reason") or "stop", "logprobs": None}],
        "usage": {"prompt_tokens": int(usage.get("prompt_tokens") or 0),
                  "completion_tokens": int(usage.get("completion_tokens") or 0),
                  "total_tokens": int(usage.get("total_tokens") or 0)},
        "conversation_id": result["conversation_id"], "response_id": result["response_id"],
    }


def chat_chunk(chunk_id: str, model: str, created: int, delta: dict[str, Any],
               finish_reason: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"id": chunk_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}], **extra}
