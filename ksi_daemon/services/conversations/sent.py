"""What the model was sent for one exchange, rebuilt from storage: the system message with its
notes, the history exchanges shown (tool calls and their results among them), the new input and
the files embedded with it.

The response file keeps only the raw input; its outcome line records which exchanges were shown
(`sent`), so the rebuild names the same ones. Exchanges written before that record existed are
rebuilt as if every earlier exchange had fit, and say so (`recorded: false`).
"""

from __future__ import annotations

from typing import Any

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.ids import is_safe_id
from ksi_common.items import ABANDONED_ARGUMENTS, call_ids_abandoned, function_calls, item_line, output_text
from ksi_common.records import IndexEntry
from ksi_common.transcripts import Transcripts, exchange_items
from ksi_daemon.services.conversations.history import system_notes
from ksi_daemon.services.conversations.stand_ins import Block, summary_block

FILES_PLACEHOLDER = "[attached files were embedded here; their content is read at send time and not stored]"


def _system_in_force(meta: dict[str, Any], n: int) -> str | None:
    """The system prompt in force for exchange `n` (changes made by `n` itself included)."""
    changes = [c for c in meta.get("system_changes") or [] if isinstance(c, dict) and int(c.get("from_n") or 0) <= n]
    if changes:
        return changes[-1].get("system")
    return meta.get("system") if not meta.get("system_changes") else None


def _input_messages(exchange: dict[str, Any], part: str, n: int) -> list[dict[str, Any]]:
    """An exchange's input as chat messages: user messages (images and files named by reference,
    `[from AGENT]` applied) and tool results; its system lines live in the system message."""
    lines, inputs, _output = exchange_items(exchange)
    messages = []
    for line, item in zip(lines, inputs, strict=True):
        if item.get("type") == "function_call_output":
            messages.append({"role": "tool", "call_id": item.get("call_id"), "content": str(item.get("output") or ""),
                             "part": part, "n": n})
        elif item.get("role") != "system":
            content = item_line(item)
            if line.get("from_agent"):
                content = f"[from {line['from_agent']}] {content}"
            messages.append({"role": "user", "content": content, "part": part, "n": n})
    return messages


def _reply_message(exchange: dict[str, Any], n: int, abandoned: set[str]) -> dict[str, Any]:
    """An exchange's output as the one assistant message a history shows: its text and its tool
    calls, an abandoned call's arguments as their stand-in (a reasoning summary is not sent back)."""
    _lines, _inputs, output = exchange_items(exchange)
    message: dict[str, Any] = {"role": "assistant", "content": output_text(output), "part": "history", "n": n}
    calls = [{"call_id": c.get("call_id"), "name": c.get("name"),
              "arguments": ABANDONED_ARGUMENTS if str(c.get("call_id")) in abandoned else c.get("arguments")}
             for c in function_calls(output)]
    if calls:
        message["tool_calls"] = calls
    return message


def _numbers(runs: list[Any]) -> list[int]:
    shown: list[int] = []
    for run in runs:
        if isinstance(run, list) and len(run) == 2 and all(isinstance(x, int) for x in run):
            shown.extend(range(run[0], run[1] + 1))
    return shown


async def _stand_in(reader: Transcripts, sent: dict[str, Any]) -> list[Block]:
    """What stood in for the earliest exchanges: stored summaries by owner and range (read back),
    a fallback or digest made for that turn from the text kept with the record. A record written
    before chunks names one running summary of 1..upto."""
    refs = sent.get("stand_in")
    if not isinstance(refs, list):
        old = sent.get("summary")
        refs = [{**old, "first": 1, "kind": "summary"}] if isinstance(old, dict) else []
    blocks: list[Block] = []
    for ref in refs:
        if not isinstance(ref, dict) or not isinstance(ref.get("upto"), int):
            continue
        first, upto, kind = int(ref.get("first") or 1), ref["upto"], str(ref.get("kind") or "summary")
        if isinstance(ref.get("text"), str):
            blocks.append(Block(first, upto, kind if kind in ("digest", "recent") else "recent", ref["text"]))
            continue
        owner = ref.get("conversation_id")
        if not isinstance(owner, str) or not is_safe_id(owner):
            continue
        found = [s for s in await reader.reader.summaries(owner) if s.upto == upto and s.first == first]
        if found:
            blocks.append(summary_block(found[-1]))
    return blocks


def _history_messages(exchanges: dict[int, dict[str, Any]], shown: list[int], n: int) -> list[dict[str, Any]]:
    """The history exchanges `shown` with exchange `n`, as chat messages; the calls an output among
    them abandoned went with their stand-in arguments."""
    abandoned = {call_id for k in [*shown, n] for call_id in call_ids_abandoned(exchange_items(exchanges[k])[1])}
    messages: list[dict[str, Any]] = []
    for k in shown:
        past = exchanges[k]
        turn = _input_messages(past, "history", k)
        if not turn or past.get("reply") is None:
            continue  # the daemon leaves out an exchange whose input or reply it cannot read
        messages.extend(turn)
        messages.append(_reply_message(past, k, abandoned))
    return messages


async def rebuild_sent(reader: Transcripts, conversation_id: str, n: int, now: float) -> dict[str, Any]:
    """The messages of exchange `n` of a conversation (its fork chain included), as sent, with
    where the request first differed from the one before it (why the cache missed)."""
    transcript = await reader.transcript(conversation_id, True, now)
    exchanges = {x["n"]: x for x in transcript["exchanges"]}
    if n not in exchanges:
        raise KsiError(ErrorCode.VALIDATION_ERROR, f"conversation {conversation_id} has no exchange {n}",
                       fields={"n": f"no exchange {n}"}, exchanges=sorted(exchanges))
    shown = await _rebuilt(reader, conversation_id, exchanges, n)
    previous = max((k for k in exchanges if k < n), default=None)
    earlier = (await _rebuilt(reader, conversation_id, exchanges, previous))["messages"] if previous else None
    return {**shown, "compared_with": previous, **first_difference(earlier, shown["messages"])}


async def _rebuilt(reader: Transcripts, conversation_id: str, exchanges: dict[int, dict[str, Any]],
                   n: int) -> dict[str, Any]:
    """Exchange `n` rebuilt from its record: the messages sent, their breakpoints marked."""
    exchange = exchanges[n]
    record = await reader.response(exchange["response_id"])
    outcome = (record.outcome or {}) if record is not None else {}
    sent = outcome.get("sent")
    recorded = isinstance(sent, dict)
    if recorded:
        shown = [k for k in _numbers(sent.get("history") or []) if k in exchanges]
        omitted = int(sent.get("omitted") or 0)
        files = [f for f in sent.get("files") or [] if isinstance(f, dict)]
    else:
        shown = [k for k, x in sorted(exchanges.items()) if k < n and not x.get("is_feedback")]
        omitted, files = 0, []
    # the same notes the daemon appended, rebuilt from the exchanges shown
    entries = [IndexEntry(n=k, response_id=exchanges[k]["response_id"], model=exchanges[k].get("model"),
                          agent_id=exchanges[k].get("agent_id")) for k in shown]
    stand_in = await _stand_in(reader, sent) if recorded else []
    notes = system_notes(omitted, entries, "\n\n".join(b.render() for b in stand_in) if stand_in else None)
    instructions = outcome.get("instructions")  # a system prompt for that request alone
    system = instructions if isinstance(instructions, str) else _system_in_force(
        await reader.require_meta(exchange["conversation_id"]), n)
    messages: list[dict[str, Any]] = []
    system_text = "\n\n".join([system, *notes] if system else notes)
    if system_text:
        messages.append({"role": "system", "content": system_text, "part": "system"})
    messages.extend(_history_messages(exchanges, shown, n))
    inputs = _input_messages(exchange, "input", n)
    users = [m for m in inputs if m["role"] == "user"]
    if files and users:
        users[-1]["content"] = f"{FILES_PLACEHOLDER}\n\n{users[-1]['content']}"
    messages.extend(inputs)
    # None: recorded before breakpoints were (or nothing recorded), so unknown; []: none were placed
    breakpoints = sent.get("breakpoints") if recorded and isinstance(sent.get("breakpoints"), list) else None
    mark_breakpoints(messages, breakpoints or [])
    reply = exchange.get("reply") or {}
    return {
        "conversation_id": conversation_id,
        "n": n,
        "response_id": exchange["response_id"],
        "model": exchange.get("model"),
        "recorded": recorded,
        "resumed_session": bool(recorded and sent.get("resumed_session")),
        "history": shown,
        "omitted": omitted,
        "notes": notes,
        # which summary (or fallback made for the turn) stood for which range
        "stand_in": [{"first": b.first, "upto": b.upto, "kind": b.kind,
                      **({"conversation_id": b.owner} if b.owner else {})} for b in stand_in],
        "files": files,
        "messages": messages,
        "breakpoints": breakpoints,
        "reply": reply.get("content"),
        "output": exchange.get("output") or [],  # the reply as items: its text, tool calls, reasoning
        "usage": reply.get("usage"),
    }


def _marked_index(messages: list[dict[str, Any]], point: dict[str, Any]) -> int | None:
    """The rebuilt message a recorded breakpoint was on: at its index when that message is of the
    recorded part, else the last message of that part (a history exchange's reply, say)."""
    part = "system" if point.get("part") in ("system", "summary") else point.get("part")
    n = point.get("n")

    def fits(i: int) -> bool:
        return messages[i].get("part") == part and (n is None or messages[i].get("n") == n)

    at = point.get("at")
    if isinstance(at, int) and 0 <= at < len(messages) and fits(at):
        return at
    return next((i for i in range(len(messages) - 1, -1, -1) if fits(i)), None)


def mark_breakpoints(messages: list[dict[str, Any]], breakpoints: list[Any]) -> None:
    """Each message a breakpoint closed carries `cache_breakpoints` ({part, ttl, by}), in order."""
    for point in breakpoints:
        index = _marked_index(messages, point) if isinstance(point, dict) else None
        if index is not None:
            messages[index].setdefault("cache_breakpoints", []).append(
                {"part": point.get("part"), "ttl": point.get("ttl"), "by": point.get("by")})


def _compared(message: dict[str, Any]) -> tuple[Any, ...]:
    return message.get("role"), message.get("content"), message.get("tool_calls"), message.get("call_id")


def first_difference(previous: list[dict[str, Any]] | None, current: list[dict[str, Any]]) -> dict[str, Any]:
    """The index of the first message where `current` differs from the `previous` request (by
    role, content, tool calls; None: no previous request, or the same messages), and whether
    `previous` is a prefix of it: a provider's prefix cache can only read up to that index."""
    if previous is None:
        return {"first_difference": None, "extends_previous": False}
    before, now = [_compared(m) for m in previous], [_compared(m) for m in current]
    index = next((i for i, (a, b) in enumerate(zip(before, now, strict=False)) if a != b), min(len(before), len(now)))
    same = before == now
    return {"first_difference": None if same else index, "extends_previous": index == len(before) and not same}
