"""Export formats of a conversation (markdown, json, jsonl) and parsing them back for import.

Pure functions over a transcript (see `ksi_common.transcripts`): the daemon's
`conversation:export` and `ksi conversation export` both render through here.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from ksi_common import items, transcripts
from ksi_common.errors import ErrorCode, KsiError

FORMATS = ("markdown", "json", "jsonl")
DOCUMENT = "ksi.conversation"  # the `format` marker of json and jsonl exports

# conversation fields an export carries (the rest is bookkeeping of the var dir it came from)
CONVERSATION_FIELDS = ("conversation_id", "title", "tags", "status", "agent_id", "system", "created",
                       "last_activity", "ttl", "turn_cap", "parent_id", "fork_at", "models", "pins")


def export_document(transcript: dict[str, Any]) -> dict[str, Any]:
    """The json export: conversation fields and every exchange, inherited ones marked."""
    conversation = transcript["conversation"]
    document: dict[str, Any] = {
        "v": 1,
        "format": DOCUMENT,
        "conversation": {key: conversation.get(key) for key in CONVERSATION_FIELDS},
        "exchanges": transcript["exchanges"],
    }
    if transcript.get("missing_parent"):
        document["missing_parent"] = transcript["missing_parent"]
    if transcript.get("summaries"):
        document["summaries"] = transcript["summaries"]  # each marked `type: summary`
    return document


def render(transcript: dict[str, Any], fmt: str) -> str:
    if fmt == "markdown":
        return render_markdown(transcript)
    if fmt == "json":
        return orjson.dumps(export_document(transcript), option=orjson.OPT_INDENT_2).decode() + "\n"
    if fmt == "jsonl":
        return render_jsonl(transcript)
    raise KsiError(ErrorCode.VALIDATION_ERROR, f"unknown export format {fmt!r}",
                   fields={"format": f"one of {', '.join(FORMATS)}"})


def render_jsonl(transcript: dict[str, Any]) -> str:
    """A header line (`type: conversation`) then one line per exchange (`type: exchange`)."""
    document = export_document(transcript)
    header = {"v": 1, "type": "conversation", "format": DOCUMENT, **document["conversation"]}
    if "missing_parent" in document:
        header["missing_parent"] = document["missing_parent"]
    lines = [header] + [{"v": 1, "type": "exchange", **exchange} for exchange in document["exchanges"]]
    lines += [{**summary, "v": 1, "type": "summary"} for summary in document.get("summaries", [])]
    return "".join(orjson.dumps(line).decode() + "\n" for line in lines)


def _files_line(files: list[Any]) -> str:
    parts = []
    for ref in files:
        if not isinstance(ref, dict):
            continue
        detail = []
        if ref.get("size") is not None:
            detail.append(f"{ref['size']} bytes")
        if ref.get("sha256"):
            detail.append(f"sha256 {str(ref['sha256'])[:12]}")
        if ref.get("missing"):
            detail.append("missing")
        parts.append(f"`{ref.get('path')}`" + (f" ({', '.join(detail)})" if detail else ""))
    return "Files: " + ", ".join(parts)


def _speaker(item: dict[str, Any]) -> str:
    kind = item.get("type") or "user"
    label = {"user": "User", "feedback": "Feedback", "system": "System"}.get(kind, kind.title())
    if item.get("from_agent"):
        label += f" (from agent {item['from_agent']})"
    return label


def _fenced(text: str, language: str = "") -> list[str]:
    """`text` in a code fence longer than any run of backticks inside it."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return [f"{fence}{language}", text, fence, ""]


def _input_markdown(line: dict[str, Any], item: dict[str, Any]) -> list[str]:
    if item.get("type") == "function_call_output":
        return [f"**Tool output** (call `{item.get('call_id')}`)", "", *_fenced(str(item.get("output") or ""))]
    speaker = _speaker(line) if line else ("System" if item.get("role") == "system" else "User")
    content = item.get("content")
    if isinstance(content, list):
        texts = [str(part.get("text") or "") for part in content if part.get("type") == "input_text"]
        labels = [items.part_label(part) for part in content if part.get("type") != "input_text"]
        out = [f"**{speaker}**", "", "\n\n".join(texts), ""] if texts else [f"**{speaker}**", ""]
        out += [*(f"- {label}" for label in labels), ""] if labels else []
    else:
        out = [f"**{speaker}**", "", str(content or ""), ""]
    if line.get("files"):
        out += [_files_line(line["files"]), ""]
    return out


def _output_markdown(item: dict[str, Any]) -> list[str]:
    kind = item.get("type")
    if kind == "function_call":
        return [f"**Tool call** `{item.get('name')}` (call `{item.get('call_id')}`)", "",
                *_fenced(str(item.get("arguments") or ""), "json")]
    if kind == "reasoning":
        quoted = [f"> {line}" if line else ">" for line in str(item.get("summary") or "").splitlines()]
        return ["**Reasoning summary**", "", *quoted, ""]
    if kind == "message":
        return ["**Assistant**", "", items.item_line(item), ""]
    return [f"*({items.item_line(item)})*", ""]


def render_markdown(transcript: dict[str, Any]) -> str:
    """A readable document: a heading, the conversation's facts, then each exchange."""
    conversation = transcript["conversation"]
    out = [f"# {conversation.get('title') or conversation['conversation_id']}", ""]
    facts = [f"- Conversation: `{conversation['conversation_id']}`"]
    if conversation.get("parent_id"):
        facts.append(f"- Forked from `{conversation['parent_id']}` at exchange {conversation.get('fork_at')}")
    if transcript.get("missing_parent"):
        facts.append(f"- Parent `{transcript['missing_parent']}` no longer exists; its exchanges are not shown")
    facts.append(f"- Status: {conversation.get('state') or conversation.get('status') or 'active'}")
    if conversation.get("tags"):
        facts.append(f"- Tags: {', '.join(conversation['tags'])}")
    if conversation.get("agent_id"):
        facts.append(f"- Agent: {conversation['agent_id']}")
    facts.append(f"- Created: {conversation.get('created')}; last activity: {conversation.get('last_activity')}")
    facts.append(f"- Exchanges: {len(transcript['exchanges'])}")
    out += facts + [""]
    if conversation.get("system"):
        out += ["**System prompt**", "", str(conversation["system"]), ""]
    summaries: dict[int, list[dict[str, Any]]] = {}
    for found in transcript.get("summaries") or []:
        summaries.setdefault(int(found["upto"]), []).append(found)
    for exchange in transcript["exchanges"]:
        answerer = exchange.get("model") or "unknown model"
        if exchange.get("agent_id"):
            answerer = f"{exchange['agent_id']} via {answerer}"
        heading = f"## {exchange['n']}. {answerer}"
        if exchange.get("ts"):
            heading += f" · {exchange['ts']}"
        out += [heading, ""]
        notes = []
        if exchange.get("inherited"):
            notes.append(f"inherited from `{exchange['conversation_id']}`")
        if exchange.get("is_feedback"):
            notes.append("feedback, kept out of history")
        if notes:
            out += [f"*({'; '.join(notes)})*", ""]
        lines, inputs, output = transcripts.exchange_items(exchange)
        for line, item in zip(lines, inputs, strict=True):
            out += _input_markdown(line, item)
        reply = exchange.get("reply")
        if reply is None and not output:
            out += ["*(no reply recorded: the response file is missing or incomplete)*", ""]
        for item in output:
            out += _output_markdown(item)
        for summary in summaries.get(exchange["n"], []):
            span = f"{int(summary.get('first') or 1)}-{summary['upto']}"
            if summary.get("kind") == "fallback":
                written = "the fallback written without a model, as no summary passed its checks"
            else:
                written = f"a summary written by {summary.get('model') or 'the summariser'}"
            out += [f"> **Summary of exchanges {span}** ({written}, standing in for those exchanges when they "
                    "no longer fit the history)", ">"]
            out += [f"> {line}" if line else ">" for line in str(summary.get("text") or "").splitlines()]
            out += [""]
    return "\n".join(out).rstrip("\n") + "\n"


# -- import -----------------------------------------------------------------------------------


def _invalid(message: str, **fields: str) -> KsiError:
    return KsiError(ErrorCode.VALIDATION_ERROR, message, fields=fields or {"data": message})


def _from_jsonl(lines: list[Any]) -> dict[str, Any]:
    header: dict[str, Any] | None = None
    exchanges = []
    for position, line in enumerate(lines, start=1):
        if not isinstance(line, dict):
            raise _invalid(f"line {position} of the jsonl export is not an object")
        kind = line.get("type")
        if kind == "conversation":
            header = {k: v for k, v in line.items() if k not in ("v", "type", "format")}
        elif kind == "exchange":
            exchanges.append({k: v for k, v in line.items() if k not in ("v", "type")})
        elif kind == "summary":
            continue  # summaries are derived from the exchanges; an import writes its own later
        else:
            raise _invalid(f"line {position} of the jsonl export has unknown type {kind!r}")
    if header is None:
        raise _invalid("the jsonl export has no conversation line")
    return {"v": 1, "format": DOCUMENT, "conversation": header, "exchanges": exchanges}


def parse_export(payload: Any, fmt: str | None = None) -> dict[str, Any]:
    """A json or jsonl export (text, or already parsed) as an export document; raises
    `validation_error` for anything else (markdown exports cannot be imported)."""
    if fmt == "markdown":
        raise _invalid("markdown exports cannot be imported; export as json or jsonl", format="json or jsonl")
    if isinstance(payload, str):
        text = payload.strip()
        if fmt != "jsonl":
            try:
                payload = orjson.loads(text)
            except orjson.JSONDecodeError:
                if fmt == "json":
                    raise _invalid("the export is not valid JSON") from None
                payload = None
        if payload is None or fmt == "jsonl":
            try:
                payload = [orjson.loads(line) for line in text.splitlines() if line.strip()]
            except orjson.JSONDecodeError as exc:
                raise _invalid(f"the export is neither JSON nor JSON lines: {exc}") from None
    if isinstance(payload, list):
        payload = _from_jsonl(payload)
    if not isinstance(payload, dict) or payload.get("format") != DOCUMENT:
        raise _invalid(f"not a KSI conversation export (expected format {DOCUMENT!r})")
    conversation = payload.get("conversation")
    exchanges = payload.get("exchanges")
    if not isinstance(conversation, dict) or not isinstance(exchanges, list):
        raise _invalid("the export needs a conversation object and an exchanges list")
    for position, exchange in enumerate(exchanges, start=1):
        if not isinstance(exchange, dict) or not (isinstance(exchange.get("inputs"), list)
                                                  or isinstance(exchange.get("input"), list)):
            raise _invalid(f"exchange {position} has no inputs list", **{f"exchanges.{position}": "no inputs"})
        reply = exchange.get("reply")
        if reply is not None and not (isinstance(reply, dict) and isinstance(reply.get("content"), str)):
            raise _invalid(f"exchange {position} has a malformed reply", **{f"exchanges.{position}": "bad reply"})
    return payload
