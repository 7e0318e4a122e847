"""A transcript on the terminal: the conversation's facts, then each exchange as the lines a person
reads (`user: ...`, `→ call weather({"city": "Oslo"}) [c1]`, `← c1: 12C`, `assistant: ...`),
images and files named by reference.

Text from models and users is printed as text, never read as rich markup.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.rule import Rule
from rich.text import Text

from ksi_common.items import item_line
from ksi_common.transcripts import cache_use, exchange_items

ROLE_STYLES = {"user": "bold cyan", "feedback": "bold cyan", "system": "bold magenta", "assistant": "bold green"}


def _files(files: list[Any]) -> list[Text]:
    shown = []
    for ref in files:
        if not isinstance(ref, dict):
            continue
        facts = [f"{ref['size']} bytes" if ref.get("size") is not None else "",
                 f"sha256 {str(ref['sha256'])[:12]}" if ref.get("sha256") else "",
                 "missing" if ref.get("missing") else ""]
        detail = ", ".join(fact for fact in facts if fact)
        shown.append(Text(f"  file {ref.get('path')}" + (f" ({detail})" if detail else ""), style="dim"))
    return shown


def exchange_lines(exchange: dict[str, Any]) -> list[Text]:
    """One exchange's lines: its inputs, then its reply, in the order they were made."""
    out: list[Text] = []
    lines, inputs, output = exchange_items(exchange)
    for line, item in zip(lines, inputs, strict=True):
        if item.get("type") == "message":
            role = str(line.get("type") or item.get("role") or "user")
            label = role + (f" from {line['from_agent']}" if line.get("from_agent") else "")
            out.append(Text.assemble((f"{label}: ", ROLE_STYLES.get(role, "bold")), item_line(item)))
            out += _files(line.get("files") or [])
        else:
            out.append(Text(item_line(item), style="yellow"))
    if exchange.get("reply") is None and not output:
        out.append(Text("(no reply recorded: the response file is missing or incomplete)", style="red"))
    for item in output:
        kind = item.get("type")
        if kind == "message":
            out.append(Text.assemble(("assistant: ", ROLE_STYLES["assistant"]), item_line(item)))
        elif kind == "reasoning":
            out.append(Text(item_line(item), style="dim italic"))
        else:
            out.append(Text(item_line(item), style="yellow"))
    return out


def _heading(exchange: dict[str, Any]) -> str:
    answerer = exchange.get("model") or "unknown model"
    if exchange.get("agent_id"):
        answerer = f"{exchange['agent_id']} via {answerer}"
    notes = [f"#{exchange['n']} {answerer}"]
    if exchange.get("ts"):
        notes.append(str(exchange["ts"]))
    if exchange.get("inherited"):
        notes.append(f"inherited from {exchange['conversation_id']}")
    if exchange.get("is_feedback"):
        notes.append("feedback, kept out of history")
    turn = cache_use([exchange])["turns"][0]
    if turn["read"] or turn["created"]:
        notes.append(_cache_note(turn))
    return " · ".join(notes)


def _cache_note(counts: dict[str, Any]) -> str:
    rate = counts["hit_rate"]
    shown = f"{rate:.0%}" if rate is not None else "n/a"
    return f"cache {shown} ({counts['read']} read, {counts['created']} written)"


def print_transcript(transcript: dict[str, Any], console: Console) -> None:
    conversation = transcript["conversation"]
    console.print(Text(str(conversation.get("title") or conversation["conversation_id"]), style="bold"))
    facts = [f"conversation {conversation['conversation_id']}",
             str(conversation.get("state") or conversation.get("status") or "active"),
             f"{len(transcript['exchanges'])} exchanges"]
    if conversation.get("parent_id"):
        facts.append(f"forked from {conversation['parent_id']} at {conversation.get('fork_at')}")
    if transcript.get("missing_parent"):
        facts.append(f"parent {transcript['missing_parent']} no longer exists")
    if conversation.get("agent_id"):
        facts.append(f"agent {conversation['agent_id']}")
    console.print(Text(" · ".join(facts), style="dim"))
    if conversation.get("system"):
        console.print(Text.assemble(("system: ", ROLE_STYLES["system"]), str(conversation["system"])))
    summaries: dict[int, list[dict[str, Any]]] = {}
    for found in transcript.get("summaries") or []:
        summaries.setdefault(int(found["upto"]), []).append(found)
    for exchange in transcript["exchanges"]:
        console.print(Rule(Text(_heading(exchange)), align="left", style="dim"))
        for line in exchange_lines(exchange):
            console.print(line)
        for summary in summaries.get(exchange["n"], []):
            span = f"{int(summary.get('first') or 1)}-{summary['upto']}"
            kind = "fallback" if summary.get("kind") == "fallback" else "summary"
            console.print(Text(f"{kind} of exchanges {span}: {summary.get('text') or ''}", style="dim italic"))
    _print_cache_use(transcript["exchanges"], console)


def _print_cache_use(exchanges: list[dict[str, Any]], console: Console) -> None:
    """The prompt-cache hit rate per model, when a provider reported any cache use."""
    use = cache_use(exchanges)
    if not (use["read"] or use["created"]):
        return
    console.print(Rule(style="dim"))
    for model, counts in use["models"].items():
        console.print(Text(f"{model}: {_cache_note(counts)}", style="dim"))
