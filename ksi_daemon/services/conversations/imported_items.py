"""The items of an imported document, checked whole and turned into response-record lines.

An export carries each exchange's items (`input`, `output`) beside its input lines (`inputs`: who
sent each and when) and its reply (model, usage); a document made before items has only the
lines and the reply's text. Either way the items are checked here before anything is written:
each fault has its own code (an item type KSI does not know, an output for a call no earlier
exchange made, a call id used twice, arguments that are not JSON text), and the field it names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ksi_common import items
from ksi_common.errors import ErrorCode, KsiError
from ksi_common.items import INPUT_ITEM_TYPES, OUTPUT_ITEM_TYPES, PART_TYPES, Item
from ksi_daemon.services.conversations.imports import ImportedDocument, ImportedExchange, ImportedInput
from ksi_daemon.services.conversations.response_lines import item_line

SHA256 = re.compile(r"[0-9a-f]{64}")
MESSAGE_LINE_TYPES = ("user", "feedback", "system")
ITEM_TYPES = INPUT_ITEM_TYPES | OUTPUT_ITEM_TYPES


@dataclass(slots=True)
class ExchangeItems:
    """One exchange's checked items: what it took in (with the line each came from, if any) and
    what it gave out (empty: the exchange has no reply and is not imported)."""

    input: list[Item] = field(default_factory=list)
    lines: list[ImportedInput | None] = field(default_factory=list)
    output: list[Item] = field(default_factory=list)
    stored_images: list[tuple[str, str]] = field(default_factory=list)  # (field, sha256) of each stored image


def _fault(code: ErrorCode, where: str, message: str) -> KsiError:
    return KsiError(code, f"the export cannot be imported: {where}: {message}", fields={f"data.{where}": message})


def _invalid(where: str, message: str) -> KsiError:
    return _fault(ErrorCode.VALIDATION_ERROR, where, message)


def _text(item: dict[str, Any], key: str, where: str, *, blank: bool = True) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (not blank and not value.strip()):
        raise _invalid(f"{where}.{key}", "must be text" if blank else "must be non-empty text")
    return value


def _ref(ref: Any, where: str) -> dict[str, Any]:
    """A reference to stored bytes: an sha256 or an https URL; the bytes themselves never."""
    if not isinstance(ref, dict):
        raise _invalid(where, "must be a reference object (sha256 or url, media_type, bytes)")
    checked: dict[str, Any] = {}
    sha = ref.get("sha256")
    if sha is not None:
        if not isinstance(sha, str) or not SHA256.fullmatch(sha):
            raise _invalid(f"{where}.sha256", "must be 64 lowercase hex digits")
        checked["sha256"] = sha
    url = ref.get("url")
    if url is not None:
        # https only, as a request's image URL: bytes (a data URL) are never imported
        if not isinstance(url, str) or not url.lower().startswith("https://"):
            raise _invalid(f"{where}.url", "must be an https URL; bytes (a data URL) are never imported")
        checked["url"] = url
    if not checked:
        raise _invalid(where, "names no stored bytes: give its sha256 or its https url")
    for key in ("media_type", "detail", "name"):
        if ref.get(key) is not None:
            checked[key] = _text(ref, key, where)
    if "name" in checked:  # the file's own name: an export from before names were cut kept its path
        name = items.file_name(checked.pop("name"))
        if name:
            checked["name"] = name
    # an image's size in pixels, a PDF's pages: what their prompt tokens are counted by
    for key in ("width", "height", "pages"):
        value = ref.get(key)
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise _invalid(f"{where}.{key}", "must be a whole number from 1")
            checked[key] = value
    size = ref.get("bytes")
    if size is not None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise _invalid(f"{where}.bytes", "must be the size in bytes, a whole number from 0")
        checked["bytes"] = size
    return checked


def _content(item: dict[str, Any], where: str) -> str | list[dict[str, Any]]:
    content = item.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise _invalid(f"{where}.content", "must be text or a non-empty list of parts")
    parts: list[dict[str, Any]] = []
    for position, part in enumerate(content):
        at = f"{where}.content.{position}"
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(part, dict) or kind not in PART_TYPES:
            raise _fault(ErrorCode.UNKNOWN_ITEM_TYPE, f"{at}.type",
                         f"unknown part type {kind!r} (one of {', '.join(sorted(PART_TYPES))})")
        if kind == "input_text":
            parts.append({"type": kind, "text": _text(part, "text", at)})
        elif kind == "input_image":
            parts.append({"type": kind, "image": _ref(part.get("image"), f"{at}.image")})
        else:
            parts.append({"type": kind, "file": _ref(part.get("file"), f"{at}.file")})
    return parts


def _kind(item: Any, where: str, allowed: frozenset[str], side: str) -> str:
    if not isinstance(item, dict):
        raise _invalid(where, "an item is an object with a type")
    kind = item.get("type")
    if kind not in ITEM_TYPES:
        raise _fault(ErrorCode.UNKNOWN_ITEM_TYPE, f"{where}.type",
                     f"unknown item type {kind!r} (one of {', '.join(sorted(ITEM_TYPES))})")
    if kind not in allowed:
        raise _invalid(f"{where}.type", f"an exchange's {side} holds {' and '.join(sorted(allowed))} items, not {kind}")
    return str(kind)


class _Calls:
    """The call ids of the document so far: each made once, answered at most once, after it was made
    and before the next user message."""

    def __init__(self) -> None:
        self.made: set[str] = set()
        self.answered: set[str] = set()

    def copy(self) -> _Calls:
        calls = _Calls()
        calls.made, calls.answered = set(self.made), set(self.answered)
        return calls

    def answer(self, call_id: str, where: str) -> None:
        if call_id not in self.made:
            raise _fault(ErrorCode.UNKNOWN_CALL_ID, f"{where}.call_id",
                         f"output for call {call_id!r}, which no earlier exchange made")
        if call_id in self.answered:
            raise _fault(ErrorCode.DUPLICATE_CALL_ID, f"{where}.call_id", f"call {call_id!r} is answered twice")
        self.answered.add(call_id)

    def before_message(self, where: str) -> None:
        """A user's message comes after every call made so far has its output: no model takes a
        history in which a call is left hanging (nor could it be replayed)."""
        waiting = sorted(self.made - self.answered)
        if waiting:
            raise _invalid(where, f"a user message while call {waiting[0]!r} has no output yet "
                                  "(its function_call_output comes first)")

    def make(self, call_id: str, where: str) -> None:
        if call_id in self.made:
            raise _fault(ErrorCode.DUPLICATE_CALL_ID, f"{where}.call_id", f"call id {call_id!r} is used twice")
        self.made.add(call_id)


def _input_item(item: Any, where: str, calls: _Calls) -> Item:
    kind = _kind(item, where, INPUT_ITEM_TYPES, "input")
    if kind == "function_call_output":
        call_id = _text(item, "call_id", where, blank=False)
        calls.answer(call_id, where)
        return items.with_client_form({"type": kind, "call_id": call_id, "output": _text(item, "output", where)}, item)
    role = item.get("role", "user")
    if role not in ("user", "system"):
        raise _invalid(f"{where}.role", "an input message is the user's or the system's")
    if role == "user":
        calls.before_message(where)
    return items.message(role, _content(item, where))


def _output_item(item: Any, where: str, calls: _Calls) -> Item:
    kind = _kind(item, where, OUTPUT_ITEM_TYPES, "output")
    if kind == "function_call":
        call_id = _text(item, "call_id", where, blank=False)
        arguments = item.get("arguments")
        # text, as the model sent it: a model's arguments that are not JSON are stored as they came,
        # so an export holding them must import again (the model is shown them as they were)
        if not isinstance(arguments, str):
            raise _fault(ErrorCode.ARGUMENTS_NOT_JSON, f"{where}.arguments",
                         "must be text (a string holding the arguments as the model sent them)")
        calls.make(call_id, where)
        return items.with_client_form({"type": kind, "call_id": call_id, "name": _text(item, "name", where, blank=False),
                                       "arguments": arguments}, item)
    if kind == "reasoning":
        reasoning: Item = {"type": kind, "summary": _text(item, "summary", where)}
        if isinstance(item.get("thinking_blocks"), list):  # a provider's own, signed: replayed to it as they came
            reasoning["thinking_blocks"] = item["thinking_blocks"]
        return reasoning
    if item.get("role", "assistant") != "assistant":
        raise _invalid(f"{where}.role", "an output message is the assistant's")
    return items.message("assistant", _text(item, "content", where))


def _line_item(line: ImportedInput, where: str) -> dict[str, Any]:
    """The item a line of a document made before items stands for (as `items.input_items` reads a
    record line), unchecked: the item checks then name any fault."""
    if line.type == "function_call_output":
        return {"type": line.type, "call_id": line.call_id, "output": line.output}
    if line.type in ("assistant", "error"):  # a record's outcome line: known, but never an input
        raise _invalid(f"{where}.type", "an input line is user, feedback, system or function_call_output")
    if line.type not in MESSAGE_LINE_TYPES:
        raise _fault(ErrorCode.UNKNOWN_ITEM_TYPE, f"{where}.type",
                     f"unknown input type {line.type!r} (one of user, feedback, system, function_call_output)")
    return {"type": "message", "role": "system" if line.type == "system" else "user", "content": line.content}


def _exchange_items(exchange: ImportedExchange, where: str, calls: _Calls) -> ExchangeItems:
    found = ExchangeItems()
    if exchange.input is not None:
        if exchange.inputs and len(exchange.inputs) != len(exchange.input):
            raise _invalid(f"{where}.inputs", f"has {len(exchange.inputs)} lines for {len(exchange.input)} input items")
        raw: list[Any] = list(exchange.input)
        found.lines = list(exchange.inputs) if exchange.inputs else [None] * len(raw)
        side = f"{where}.input"
    else:
        raw = [_line_item(line, f"{where}.inputs.{k}") for k, line in enumerate(exchange.inputs)]
        found.lines = list(exchange.inputs)
        side = f"{where}.inputs"
    found.input = [_input_item(item, f"{side}.{k}", calls) for k, item in enumerate(raw)]
    for k, item in enumerate(found.input):
        content = item.get("content")
        for position, part in enumerate(content if isinstance(content, list) else ()):
            key = "image" if part.get("type") == "input_image" else "file"  # a file's bytes must be stored too
            ref = part.get(key) or {}
            if ref.get("sha256") is not None and not ref.get("url"):
                found.stored_images.append((f"data.{side}.{k}.content.{position}.{key}.sha256", ref["sha256"]))
    if exchange.output is not None:
        found.output = [_output_item(item, f"{where}.output.{k}", calls) for k, item in enumerate(exchange.output)]
        if not found.output and exchange.reply is not None:
            raise _invalid(f"{where}.output", "an exchange with a reply gives out at least one item")
    elif exchange.reply is not None:
        found.output = [items.message("assistant", exchange.reply.content)]
    return found


def checked_items(document: ImportedDocument) -> list[ExchangeItems]:
    """Every exchange's items in document order, or the first fault (nothing is written before this
    passes).

    An exchange without a reply is not imported, so which ones are skipped is decided first and
    calls are matched with their outputs over the kept exchanges only: a skipped exchange's items
    are checked on a copy of the calls so far, and the outputs it gave count for nothing (a kept
    call whose only output was skipped is then unanswered before the next user message, refused
    as any such history)."""
    calls = _Calls()
    found = []
    for k, exchange in enumerate(document.exchanges):
        kept = exchange.reply is not None or bool(exchange.output)
        found.append(_exchange_items(exchange, f"exchanges.{k}", calls if kept else calls.copy()))
    return found


def imported_lines(found: ExchangeItems, is_feedback: bool, conversation_id: str, ts: str) -> list[dict[str, Any]]:
    """The response-record input lines of an imported exchange: each item as `ksi_common.items`
    stores it, with the time, agent and files its line in the document gave."""
    lines = []
    for item, line in zip(found.input, found.lines, strict=True):
        user_type = line.type if line is not None and line.type in ("user", "feedback") else (
            "feedback" if is_feedback else "user")
        text = line.content if line is not None else None
        record = item_line(item, user_type, text, (line.ts if line is not None else None) or ts, conversation_id)
        if line is not None:
            if line.agent_id is not None:
                record["agent_id"] = line.agent_id
            if line.from_agent is not None:
                record["from_agent"] = line.from_agent
            if line.files:  # kept as history; `imported` means never read from disk again
                record["files"] = [{**ref.model_dump(exclude_none=True), "imported": True} for ref in line.files]
        lines.append(record)
    return lines
