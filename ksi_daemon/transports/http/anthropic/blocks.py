"""Anthropic content blocks as KSI items: a user turn's `text`, `image` and `document` blocks are one
user message, its `tool_result` blocks `function_call_output` items; an assistant turn's `text` is an
assistant message and each `tool_use` a `function_call` item. An assistant turn's `thinking` and
`redacted_thinking` blocks are one reasoning item, the reasoning item the Responses door keeps: its
text as the summary, its signed and redacted blocks as they came (`thinking_blocks`), so the client's
own history replays them to the provider that signed them. Matching leaves reasoning out, as on every
door. An image or document inside a `tool_result` (Claude Code's Read tool returns them) goes into
the turn's user message, after a line naming the result it came from: a stored tool output is
text, and chat providers take images and files in user messages only. Blocks no exchange can hold (server tools'
blocks) are refused by name.

A `document` holding a base64 PDF is a PDF part (stored by reference, as an image); one holding
plain text is that text, headed by the document's title, so it reaches every model and replays as
it came. A message holding images or PDFs keeps its text first, in one part, then those: the order
the stored exchange keeps them in, so a resent history is recognised. A PDF's bytes are checked by
the daemon, as for every door; its error is named by the block's field (see translate.in_block_terms)."""

from __future__ import annotations

from typing import Any

import orjson

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.items import Item, message

Block = dict[str, Any]
ERROR_MARK = "[tool error] "  # a tool_result with is_error: its output says so to every provider
THINKING = frozenset({"thinking", "redacted_thinking"})
SERVER_BLOCKS = "belongs to a server tool: KSI runs client tools only (the client runs each call)"


def refused(where: str, why: str) -> KsiError:
    return KsiError(ErrorCode.UNSUPPORTED_PARAMETER, f"{where} is not supported: {why}", fields={where: why})


def invalid(where: str, why: str) -> KsiError:
    return KsiError(ErrorCode.VALIDATION_ERROR, f"{where}: {why}", fields={where: why})


def _text(block: Block, where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise invalid(f"{where}.text", "a text block needs its text")
    return text


def image_part(block: Block, where: str) -> dict[str, Any]:
    """An image block as completion:async's image part: base64 bytes as a data URL, a URL as it is
    (both are stored by reference, never sent back through an event)."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source, dict) and isinstance(source.get("data"), str) \
            and isinstance(source.get("media_type"), str):
        return {"type": "input_image", "image_url": f"data:{source['media_type']};base64,{source['data']}"}
    if kind == "url" and isinstance(source, dict) and isinstance(source.get("url"), str):
        return {"type": "input_image", "image_url": source["url"]}
    if kind == "file":
        raise refused(f"{where}.source.type", "a file of Anthropic's Files API: send the image as base64 or a URL")
    raise invalid(f"{where}.source", "an image source: {type: base64, media_type, data} or {type: url, url}")


def document_parts(block: Block, where: str) -> list[dict[str, Any]]:
    """A document block as an `input_file` part (a base64 PDF, after its context as text, if any)
    or an `input_text` part (plain text, its title and context heading it)."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if not isinstance(source, dict) or kind is None:
        raise invalid(f"{where}.source", "a document source: {type: base64, media_type: application/pdf, data} "
                                         "or {type: text, media_type: text/plain, data}")
    if kind in ("url", "file", "content"):
        raise refused(f"{where}.source.type", f"a {kind} document source: send a PDF as base64, or plain text")
    citations = block.get("citations")
    if isinstance(citations, dict) and citations.get("enabled") is True:
        raise refused(f"{where}.citations", "KSI answers with text blocks, without citations")
    title, context = block.get("title"), block.get("context")
    for name, value in (("title", title), ("context", context)):
        if value is not None and not isinstance(value, str):
            raise invalid(f"{where}.{name}", "must be text")
    data = source.get("data")
    if not isinstance(data, str):
        raise invalid(f"{where}.source.data", "the document's data, as a string")
    expected = {"base64": "application/pdf", "text": "text/plain"}.get(str(kind))
    if expected is None:
        raise invalid(f"{where}.source.type", "base64 (a PDF) or text")
    if source.get("media_type", expected if kind == "text" else None) != expected:
        raise invalid(f"{where}.source.media_type", f"a {kind} document source is {expected}")
    heading = f"[document{f' {title}' if title else ''}]"
    note = f"\n{context}" if context else ""
    if kind == "text":
        return [{"type": "input_text", "text": f"{heading}{note}\n{data}"}]
    part: dict[str, Any] = {"type": "input_file", "file_data": f"data:application/pdf;base64,{data}"}
    if title:
        part["filename"] = title  # the file's name in every transcript, and to the provider
    # a PDF's context goes before it as text: the provider is sent no such field
    return [{"type": "input_text", "text": f"{heading}{note}"}, part] if context else [part]


Sourced = tuple[dict[str, Any], str | None]  # a message's part, and the block field its PDF's bytes came in


def media(block: Block, where: str) -> list[Sourced]:
    """An image or document block's parts, each PDF's with the field naming its bytes (the daemon
    checks them: its error is named by that field, see translate.in_block_terms)."""
    if block.get("type") == "image":
        return [(image_part(block, where), None)]
    return [(part, f"{where}.source.data" if part["type"] == "input_file" else None)
            for part in document_parts(block, where)]


def tool_output(block: Block, where: str) -> tuple[Item, list[Sourced]]:
    """A tool_result block as a function_call_output item: its text (a list of text blocks joined),
    marked when the client says the tool failed; and its images and documents, as the user
    message's parts (the output says they are there)."""
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise invalid(f"{where}.tool_use_id", "the id of the tool_use this result answers")
    content = block.get("content", "")
    attached: list[Sourced] = []
    if isinstance(content, list):
        texts = []
        for position, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            at = f"{where}.content.{position}"
            if kind in ("image", "document"):
                attached.extend(media(part, at))
            elif kind == "text":
                texts.append(_text(part, at))
            else:
                raise refused(f"{at}.type", f"a {kind} block in a tool result: a tool's output is kept as text, "
                                            "images and documents")
        if attached:
            texts.append(f"[{len(attached)} attachment{'s' if len(attached) > 1 else ''} of this result: "
                         "in the user's message]")
        content = "\n".join(texts)
    elif not isinstance(content, str):
        raise invalid(f"{where}.content", "a string or a list of text, image and document blocks")
    output = f"{ERROR_MARK}{content}" if block.get("is_error") is True else content
    return {"type": "function_call_output", "call_id": call_id, "output": output}, attached


def user_items(content: str | list[Block], where: str) -> tuple[list[Item], dict[int, str]]:
    """A user turn as items: its tool results first (providers want them right after the calls),
    then its text and images as one user message (none when it holds only results); and, by the
    position of each PDF part in that message, the block field its bytes came in."""
    if isinstance(content, str):
        return [message("user", content)], {}
    outputs: list[Item] = []
    parts: list[Sourced] = []
    for position, block in enumerate(content):
        at = f"{where}.{position}"
        kind = block.get("type")
        if kind == "text":
            parts.append(({"type": "input_text", "text": _text(block, at)}, None))
        elif kind in ("image", "document"):
            parts.extend(media(block, at))
        elif kind == "tool_result":
            output, attached = tool_output(block, at)
            outputs.append(output)
            if attached:  # after a line naming the call whose result they are
                parts += [({"type": "input_text", "text": f"[attachments of the result of {output['call_id']}]"},
                           None), *attached]
        elif kind in ("search_result", "container_upload") or str(kind).endswith("_tool_result"):
            raise refused(f"{at}.type", f"a {kind} block {SERVER_BLOCKS}")
        else:
            raise invalid(f"{at}.type", f"a user turn holds text, image, document and tool_result blocks, not {kind!r}")
    if not parts:
        return outputs, {}
    texts = [part["text"] for part, _source in parts if part["type"] == "input_text"]
    others = [(part, source) for part, source in parts if part["type"] != "input_text"]
    if not others:
        said = message("user", "\n\n".join(texts))
    else:  # its text then its images and PDFs: as the exchange stores them (see the module's docstring)
        said = message("user", [*([{"type": "input_text", "text": "\n".join(texts)}] if texts else []),
                                *(part for part, _source in others)])
    marker = next((block["cache_control"] for block in reversed(content) if block.get("type") in
                   ("text", "image", "document") and block.get("cache_control") is not None), None)
    if marker is not None:  # the blocks become one message: the client's breakpoint goes at its end
        said["cache_control"] = marker
    first = 1 if texts else 0
    return [*outputs, said], {first + n: source for n, (_part, source) in enumerate(others) if source is not None}


def assistant_items(content: str | list[Block], where: str) -> list[Item]:
    """An assistant turn of a resent history as output items: its text, then its calls."""
    if isinstance(content, str):
        return [message("assistant", content)]
    texts: list[str] = []
    calls: list[Item] = []
    thinking: list[Block] = []
    for position, block in enumerate(content):
        at = f"{where}.{position}"
        kind = block.get("type")
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_use":
            calls.append(_call(block, at))
        elif kind in THINKING:
            thinking.append(_thinking(block, at))
        elif kind in ("server_tool_use", "mcp_tool_use") or str(kind).endswith("_tool_result"):
            raise refused(f"{at}.type", f"a {kind} block {SERVER_BLOCKS}")
        else:
            raise invalid(f"{at}.type", f"an assistant turn holds text, tool_use and thinking blocks, not {kind!r}")
    text = "".join(texts)
    reasoning = reasoning_item(thinking)
    return [*([reasoning] if reasoning else []), *([message("assistant", text)] if text or not calls else []), *calls]


def _thinking(block: Block, where: str) -> Block:
    """A thinking block as it came (checked), or a redacted one: what the provider signed is sent back unchanged."""
    if block["type"] == "redacted_thinking":
        if not isinstance(block.get("data"), str):
            raise invalid(f"{where}.data", "a redacted_thinking block needs its data")
        return {"type": "redacted_thinking", "data": block["data"]}
    if not isinstance(block.get("thinking"), str) or not isinstance(block.get("signature", ""), str):
        raise invalid(where, "a thinking block needs its thinking (and its signature, a string)")
    return {"type": "thinking", "thinking": block["thinking"], "signature": block.get("signature", "")}


def reasoning_item(blocks: list[Block]) -> Item | None:
    """An assistant turn's thinking as a reasoning item: the blocks a provider can take back (signed
    or redacted) kept as they came; unsigned thinking (a summary KSI gave) as its text alone."""
    text = "".join(str(block.get("thinking") or "") for block in blocks)
    signed = [block for block in blocks if block.get("signature") or block["type"] == "redacted_thinking"]
    if not text and not signed:
        return None
    item: Item = {"type": "reasoning", "summary": text}
    if signed:
        item["thinking_blocks"] = signed
    return item


def _call(block: Block, where: str) -> Item:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not name:
        raise invalid(where, "a tool_use block needs its id and name")
    if not isinstance(arguments, dict):
        raise invalid(f"{where}.input", "a tool's input is an object")
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": orjson.dumps(arguments).decode()}


def pdf_payloads(contents: list[Any]) -> list[tuple[str, str]]:
    """The base64 data of every PDF document among turns' contents, those inside tool results too,
    each with the field naming it (`messages.N.content.M.source.data`)."""
    blocks = [(f"messages.{n}.content.{m}", block) for n, content in enumerate(contents)
              if isinstance(content, list) for m, block in enumerate(content) if isinstance(block, dict)]
    blocks += [(f"{where}.content.{k}", inner) for where, block in blocks if block.get("type") == "tool_result"
               and isinstance(block.get("content"), list)
               for k, inner in enumerate(block["content"]) if isinstance(inner, dict)]
    return [(f"{where}.source.data", str(block["source"]["data"])) for where, block in blocks
            if block.get("type") == "document" and isinstance(block.get("source"), dict)
            and block["source"].get("type") == "base64"]


def system_text(system: str | list[Block] | None) -> str | None:
    """The system prompt: a string, or its text blocks joined."""
    if system is None or isinstance(system, str):
        return system or None
    texts = []
    for position, block in enumerate(system):
        if block.get("type") != "text":
            raise invalid(f"system.{position}.type", "system blocks are text blocks")
        texts.append(_text(block, f"system.{position}"))
    return "\n\n".join(texts) or None
