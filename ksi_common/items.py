"""Exchange items: what one exchange took in and gave out, in the Responses API's item model.

An exchange is an ordered list of input items and an ordered list of output items. An item is a
plain dict (it is stored, exported and sent as JSON as it is):

- ``{"type": "message", "role": "user" | "system" | "assistant", "content": str | [part, ...]}``
  where a part is ``{"type": "input_text", "text": str}``, ``{"type": "input_image", "image": ref}``
  or ``{"type": "input_file", "file": ref}``; ``ref`` names stored bytes
  (``{"sha256", "media_type", "bytes"}``, plus ``"url"`` for an image kept as its https URL,
  ``"detail"`` and ``"name"`` (a file's own name, never its directories) where given; a stored image adds its ``"width"`` and ``"height"``,
  read from its header, a stored PDF its ``"pages"`` as counted at admission, and an image kept as
  its URL has only ``"url"`` and ``"detail"``).
  An assistant message's content is its text.
- ``{"type": "function_call", "call_id": str, "name": str, "arguments": str}`` (arguments: JSON text);
  a call of a tool the client runs that is not a plain function (a custom tool, a shell form, a
  namespace's function) adds ``"client_item"``: the call in the client's form (``custom_tool_call``
  with ``input``, ``local_shell_call`` or ``shell_call`` with ``action``, a ``namespace``), while
  name and arguments are the function the provider was given (see ksi_daemon.providers.tool_kinds)
- ``{"type": "function_call_output", "call_id": str, "output": str}``; the output of such a call
  adds ``"client_type"`` (``custom_tool_call_output``, ``local_shell_call_output``, ...) and, when the
  client's output was not text, ``"client_output"`` as it was sent; the stand-in output the
  daemon stores for a call the client abandoned (``conversation:abandon_calls``) has
  ``"output": ABANDONED_OUTPUT`` and adds ``"abandoned": true``
- ``{"type": "reasoning", "summary": str}`` (a provider's reasoning summary, when it returns one)

In a response record these are lines (see ``ksi_common.records``), and records written before
items existed read as one user message and one assistant message:

- an input line ``{"type": "user" | "feedback" | "system", "content": str}`` is a message; a user
  line with images or files keeps their parts in ``"parts"`` (``content`` stays its text, so every
  reader can show something);
- an input line ``{"type": "function_call_output", "call_id", "output"}`` is that item;
- the outcome line ``{"type": "assistant", "content": str}`` is one assistant message; when the
  reply holds more than its text (tool calls, a reasoning summary) the line adds ``"output"``: the
  output items in order, the text among them as an assistant message.

This module is the one place that knows how items sit in record lines. Whatever shows an item to
a person (a transcript, the CLI, the console, an export) shows a reference as `ref_public` keeps it:
never bytes, never a path on the machine that stored it.
It also knows their canonical form: what an exchange's chained digest covers (`exchange_digest`), so
a history a client resends, with its whitespace or its JSON keys in another order, is recognised.
"""

from __future__ import annotations

import hashlib
import posixpath
from typing import Any

import orjson

Item = dict[str, Any]

INPUT_LINE_TYPES = frozenset({"user", "system", "feedback", "function_call_output"})
INPUT_ITEM_TYPES = frozenset({"message", "function_call_output"})
OUTPUT_ITEM_TYPES = frozenset({"message", "function_call", "reasoning"})
PART_TYPES = frozenset({"input_text", "input_image", "input_file"})
REF_KEYS = ("sha256", "url", "media_type", "bytes", "width", "height", "detail", "name", "pages")
MEDIA_PART_TYPES = ("input_image", "input_file")
# a client's own prompt-cache breakpoint at a message's end: Anthropic's, and OpenAI's explicit one
MARKER_KEYS = ("cache_control", "prompt_cache_breakpoint")


def message(role: str, content: str | list[dict[str, Any]]) -> Item:
    return {"type": "message", "role": role, "content": content}


CLIENT_CALL_TYPES = frozenset({"function_call", "custom_tool_call", "local_shell_call", "shell_call"})
CLIENT_OUTPUT_TYPES = frozenset({"function_call_output", "custom_tool_call_output", "local_shell_call_output",
                                 "shell_call_output"})
ABANDONED_OUTPUT = "abandoned by the client: not run"  # the output stored for an abandoned call
ABANDONED_ARGUMENTS = '{"abandoned": true}'  # what a model is sent for an abandoned call's arguments (kept stored)


def with_client_form(item: Item, source: dict[str, Any]) -> Item:
    """`item` with the client's form of a call or its output that `source` carries (see above),
    and an output's abandoned mark; what is not such a form (an unknown type, a form that is not
    an object) is not kept."""
    kept: dict[str, Any] = {}
    if source.get("abandoned") is True and item.get("type") == "function_call_output":
        kept["abandoned"] = True
    client = source.get("client_item")
    if isinstance(client, dict) and client.get("type") in CLIENT_CALL_TYPES:
        kept["client_item"] = client
    if source.get("client_type") in CLIENT_OUTPUT_TYPES:
        kept["client_type"] = source["client_type"]
    if isinstance(source.get("client_output"), list | dict):
        kept["client_output"] = source["client_output"]
    return {**item, **kept} if kept else item


def input_items(lines: list[dict[str, Any]]) -> list[Item]:
    """A record's input lines as items (system lines included: callers that keep the system prompt
    elsewhere drop them)."""
    items: list[Item] = []
    for line in lines:
        kind = line.get("type")
        if kind == "function_call_output":
            items.append(with_client_form({"type": "function_call_output", "call_id": str(line.get("call_id") or ""),
                                           "output": str(line.get("output") or "")}, line))
        elif kind in ("user", "feedback", "system"):
            parts = line.get("parts")
            role = "system" if kind == "system" else "user"
            item = message(role, list(parts) if isinstance(parts, list) else str(line.get("content") or ""))
            for key in MARKER_KEYS:  # the client's cache breakpoint at its end
                if isinstance(line.get(key), dict):
                    item[key] = line[key]
            items.append(item)
    return items


def input_line_fields(item: Item, user_type: str = "user", text: str | None = None) -> dict[str, Any]:
    """The fields of the input line that stores `item` (the reverse of `input_items`): a user
    message's line is `user_type` (user or feedback); one with parts keeps them beside `text`
    (its text parts joined when not given)."""
    if item.get("type") == "function_call_output":
        return with_client_form({"type": "function_call_output", "call_id": item.get("call_id"),
                                 "output": item.get("output")}, item)
    kind = "system" if item.get("role") == "system" else user_type
    content = item.get("content")
    marker = {key: item[key] for key in MARKER_KEYS if key in item}
    if not isinstance(content, list):
        return {"type": kind, "content": str(content or ""), **marker}
    if text is None:
        text = " ".join(str(part.get("text") or "") for part in content if part.get("type") == "input_text")
    return {"type": kind, "content": text, "parts": content, **marker}


_ITEM_TEXT_FIELDS = {"function_call": ("call_id", "name", "arguments"), "function_call_output": ("call_id", "output"),
                     "reasoning": ("summary",)}


def checked_exchange_items(inputs: list[Item], outputs: list[Item]) -> None:
    """Raise ValueError naming the first item that is not an exchange's input (a user message, a
    call's output) or output (an assistant message, a call, a reasoning summary) in stored form."""
    for where, found, kinds, role in (("input", inputs, INPUT_ITEM_TYPES, "user"),
                                      ("output", outputs, OUTPUT_ITEM_TYPES, "assistant")):
        for position, item in enumerate(found):
            kind = item.get("type", "message")
            if kind not in kinds:
                raise ValueError(f"{where}.{position}: a {kind} item is not an exchange's {where}")
            if kind == "message" and (item.get("role") != role or not isinstance(item.get("content"), str | list)):
                raise ValueError(f"{where}.{position}: a {where} message is a {role} message with content")
            for key in _ITEM_TEXT_FIELDS.get(kind, ()):
                if not isinstance(item.get(key), str):
                    raise ValueError(f"{where}.{position}.{key} must be text")


def output_items(outcome: dict[str, Any] | None) -> list[Item]:
    """The output items of a record's outcome line (none for a failure or a missing outcome)."""
    if outcome is None or outcome.get("type") != "assistant":
        return []
    stored = outcome.get("output")
    if isinstance(stored, list):
        return [dict(item) for item in stored if isinstance(item, dict)]
    return [message("assistant", str(outcome.get("content") or ""))]


def output_fields(output: list[Item]) -> dict[str, Any]:
    """The fields an outcome line gets for `output`: its text as ``content``, and the items
    themselves only when they hold more than one assistant message."""
    text = output_text(output)
    if len(output) == 1 and output[0].get("type") == "message":
        return {"content": text}
    return {"content": text, "output": output}


def output_text(output: list[Item]) -> str:
    """The assistant's text among output items (empty when it only called tools)."""
    return "".join(str(item.get("content") or "") for item in output
                   if item.get("type") == "message" and isinstance(item.get("content"), str))


def function_calls(output: list[Item]) -> list[Item]:
    return [item for item in output if item.get("type") == "function_call"]


def call_ids_answered(inputs: list[Item]) -> list[str]:
    return [str(item["call_id"]) for item in inputs if item.get("type") == "function_call_output"]


def call_ids_abandoned(inputs: list[Item]) -> list[str]:
    """The ids of the calls whose outputs among `inputs` stand for calls the client abandoned."""
    return [str(item["call_id"]) for item in inputs
            if item.get("type") == "function_call_output" and item.get("abandoned") is True]


def media_parts(items: Any) -> list[dict[str, Any]]:
    """The stored `input_image` and `input_file` parts of a list of items, in order."""
    return [part for item in items if item.get("type", "message") == "message" and isinstance(item.get("content"), list)
            for part in item["content"] if isinstance(part, dict) and part.get("type") in MEDIA_PART_TYPES]


def part_text(content: str | list[dict[str, Any]]) -> str:
    """A message's text: its text parts joined, images and files named by reference."""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        kind = part.get("type")
        if kind == "input_text":
            texts.append(str(part.get("text") or ""))
        elif kind in ("input_image", "input_file"):
            ref = part.get("image") or part.get("file") or {}
            label = ref.get("url") or file_name(ref.get("name")) or f"sha256:{str(ref.get('sha256') or '')[:12]}"
            texts.append(f"[{'image' if kind == 'input_image' else 'file'} {label}]")
    return " ".join(texts)


def item_text(item: Item) -> str:
    """One line of plain text for an item: what a transcript, a summariser or a token count sees."""
    kind = item.get("type")
    if kind == "message":
        return part_text(item.get("content") or "")
    if kind == "function_call":
        return f"[call {item.get('name')}({item.get('arguments') or ''}) id={item.get('call_id')}]"
    if kind == "function_call_output":
        return f"[output of {item.get('call_id')}: {item.get('output') or ''}]"
    if kind == "reasoning":
        return f"[reasoning: {item.get('summary') or ''}]"
    return ""


def ref_public(ref: Any) -> dict[str, Any]:
    """The fields of a stored-bytes reference that may be shown: its hash, an http(s) URL, media
    type, size, detail and name (a data URL would be the bytes themselves, a path the storing
    machine's: both are left out)."""
    if not isinstance(ref, dict):
        return {}
    shown = {key: ref[key] for key in REF_KEYS if ref.get(key) is not None}
    if "name" in shown:  # a record written before names were cut to the file's own kept the path
        shown["name"] = file_name(shown["name"])
    if not str(shown.get("url") or "").lower().startswith(("https://", "http://")):
        shown.pop("url", None)
    return shown


def file_name(name: Any) -> str | None:
    """A stored name without the directories of the machine that stored it."""
    if not isinstance(name, str):
        return None
    return posixpath.basename(name.rstrip("/")) or None


def item_public(item: Item) -> Item:
    """An item as shown: image and file parts reduced to their public reference."""
    content = item.get("content")
    if item.get("type") != "message" or not isinstance(content, list):
        return dict(item)
    parts = []
    for part in content:
        if not isinstance(part, dict):
            continue
        kind = part.get("type")
        if kind == "input_image":
            parts.append({"type": kind, "image": ref_public(part.get("image"))})
        elif kind == "input_file":
            parts.append({"type": kind, "file": ref_public(part.get("file"))})
        else:
            parts.append(dict(part))
    return {**item, "content": parts}


def size_label(size: Any) -> str:
    """`512 B`, `3 KB`, `1.2 MB`."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        return ""
    if size < 1024:
        return f"{size} B"
    if size < 1024 * 1024:
        return f"{round(size / 1024)} KB"
    return f"{size / (1024 * 1024):.1f} MB"


def ref_label(kind: str, ref: dict[str, Any]) -> str:
    """`[image sha256:ab12cd34ef56… image/png 3 KB]`: what a reference names, in one bracket."""
    where = ref.get("name") or ""
    if ref.get("url"):
        where = str(ref["url"])
    elif ref.get("sha256"):
        where = f"sha256:{str(ref['sha256'])[:12]}\u2026" + (f" {ref['name']}" if ref.get("name") else "")
    words = [kind, where, str(ref.get("media_type") or ""), size_label(ref.get("bytes"))]
    return "[" + " ".join(word for word in words if word) + "]"


def part_label(part: dict[str, Any]) -> str:
    """A message part as one line of text: its text, or its reference's label."""
    kind = part.get("type")
    if kind == "input_text":
        return str(part.get("text") or "")
    if kind == "input_image":
        return ref_label("image", ref_public(part.get("image")))
    if kind == "input_file":
        return ref_label("file", ref_public(part.get("file")))
    return f"[{kind}]"


def item_line(item: Item) -> str:
    """An item as a person reads it in a transcript: `→ call weather({"city": "Oslo"}) [c1]`,
    `← c1: 12C`, a message's text with its images and files as labels."""
    kind = item.get("type")
    if kind == "message":
        content = item.get("content")
        if isinstance(content, list):
            return " ".join(part_label(part) for part in content if isinstance(part, dict))
        return str(content or "")
    if kind == "function_call":
        return f"\u2192 call {item.get('name')}({item.get('arguments') or ''}) [{item.get('call_id')}]"
    if kind == "function_call_output":
        return f"\u2190 {item.get('call_id')}: {item.get('output') or ''}"
    if kind == "reasoning":
        return f"(reasoning) {item.get('summary') or ''}"
    return f"[{kind}]"


# -- the chained digest: what makes a client-held history findable ------------------------------
# An exchange's digest covers the digest before it, the system prompt in effect for it and its
# input and output items in a canonical form: text with its whitespace collapsed, JSON arguments
# re-dumped with sorted keys, item keys sorted. A reasoning summary is left out (clients drop or
# keep it at will), and so are system messages among the inputs (the system prompt is its own
# part of the digest).

def canonical_text(text: str) -> str:
    return " ".join(text.split())


def _canonical_arguments(arguments: str) -> str:
    try:
        parsed = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return canonical_text(arguments)
    return orjson.dumps(parsed, option=orjson.OPT_SORT_KEYS).decode()


def _canonical_content(content: Any) -> Any:
    if isinstance(content, str):
        return canonical_text(content)
    parts = []
    for part in content if isinstance(content, list) else []:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            parts.append(canonical_text(str(part.get("text") or "")))
        elif kind in ("input_image", "input_file"):
            ref = part.get("image") or part.get("file") or {}
            parts.append({"type": kind, "ref": ref.get("sha256") or ref.get("url") or ref.get("name")})
    if all(isinstance(p, str) for p in parts):  # text parts alone read as their text
        return canonical_text(" ".join(parts))
    return parts


def canonical_item(item: Item) -> Item | None:
    """The form of an item its digest covers (None: the digest leaves it out)."""
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant"):
            return None
        return {"type": "message", "role": role, "content": _canonical_content(item.get("content") or "")}
    if kind == "function_call":
        return {"type": kind, "call_id": str(item.get("call_id") or ""), "name": str(item.get("name") or ""),
                "arguments": _canonical_arguments(str(item.get("arguments") or ""))}
    if kind == "function_call_output":
        return {"type": kind, "call_id": str(item.get("call_id") or ""),
                "output": canonical_text(str(item.get("output") or ""))}
    return None


def exchange_digest(previous: str | None, system: str | None, inputs: list[Item], outputs: list[Item]) -> str:
    """d_n = H(d_{n-1}, system in effect at n, canonical input and output items of n), hex."""
    body = [previous or "", canonical_text(system) if system else "",
            [c for c in map(canonical_item, inputs) if c is not None],
            [c for c in map(canonical_item, outputs) if c is not None]]
    return hashlib.sha256(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)).hexdigest()
