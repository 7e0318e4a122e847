"""Anthropic prompt-cache breakpoints placed by KSI: the end of the system prompt (which also
closes the tools, sent ahead of it), the end of the newest message, so the next turn, which
extends this one, reads everything up to it from the cache, and the end of the history before
the new input, which a fork of the conversation at that point (or an edited input) sends again.
A request whose messages already carry a client's `cache_control` is sent as it came: the client
placed its own."""

from __future__ import annotations

from typing import Any

EPHEMERAL = {"type": "ephemeral"}
MARKED_ROLES = ("system", "user", "assistant")  # litellm carries cache_control on these roles' blocks
MAX_BREAKPOINTS = 4  # Anthropic refuses a request with more


def has_markers(messages: list[dict[str, Any]]) -> bool:
    """Whether any message (or block of one) carries a client's cache_control."""
    for message in messages:
        if "cache_control" in message:
            return True
        content = message.get("content")
        if isinstance(content, list) and any(isinstance(b, dict) and "cache_control" in b for b in content):
            return True
    return False


def _marked(message: dict[str, Any]) -> dict[str, Any]:
    """A copy of `message` whose last content block carries the breakpoint."""
    content = message.get("content")
    blocks: list[dict[str, Any]] = ([{"type": "text", "text": content}] if isinstance(content, str)
                                    else [dict(b) for b in content or []])
    if not blocks:
        return message
    blocks[-1]["cache_control"] = EPHEMERAL
    return {**message, "content": blocks}


def with_breakpoints(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with KSI's breakpoints (a new list; the caller's messages are not changed)."""
    if has_markers(messages):
        return messages
    placed = list(messages)
    targets = [i for i, m in enumerate(placed) if m.get("role") == "system"][-1:]
    last = next((i for i in range(len(placed) - 1, -1, -1) if placed[i].get("role") in MARKED_ROLES), None)
    # the newest reply before the newest message closes what a fork made here, or this input
    # edited, sends again: Anthropic caches a prefix only where a breakpoint ends it
    before = next((i for i in range(last - 1, -1, -1) if placed[i].get("role") == "assistant"), None) \
        if last is not None else None
    if before is not None and _ends_in_text(placed[before]) and before not in targets:
        targets.append(before)
    if last is not None and last not in targets:
        targets.append(last)
    for index in targets:
        if isinstance(placed[index].get("content"), (str, list)):
            placed[index] = _marked(placed[index])
    return placed


def _ends_in_text(message: dict[str, Any]) -> bool:
    """Whether the message's content ends in text a breakpoint may close (not an empty reply)."""
    content = message.get("content")
    if isinstance(content, str):
        return bool(content.strip())
    last = content[-1] if isinstance(content, list) and content else None
    return isinstance(last, dict) and last.get("type") == "text" and bool(str(last.get("text") or "").strip())


def lifetime(ttl: str) -> dict[str, str]:
    """A breakpoint living `ttl` ("5m" or "1h"); five minutes is Anthropic's default, sent as before."""
    return EPHEMERAL if ttl == "5m" else {**EPHEMERAL, "ttl": ttl}


def _split_system(messages: list[dict[str, Any]], stable: list[str]) -> tuple[list[dict[str, Any]], int]:
    """`messages` with the last system message cut into blocks at the ends of the `stable` parts it
    opens with (what follows each part starts the next block, so the text sent is the same), and
    how many blocks are stable parts. Parts it does not open with, in order, are not cut at."""
    index = next((i for i in range(len(messages) - 1, -1, -1) if messages[i].get("role") == "system"), None)
    content = messages[index].get("content") if index is not None else None
    if index is None or not isinstance(content, str):
        return messages, 0
    ends, cursor = [], 0
    for part in stable:
        start = content.find(part, cursor)
        if start < cursor or content[cursor:start].strip():
            break  # only whitespace (the separator the parts were joined with) may lie between parts
        cursor = start + len(part)
        ends.append(cursor)
    cuts = [0, *ends] + ([len(content)] if cursor < len(content) else [])
    blocks = [{"type": "text", "text": content[a:b]} for a, b in zip(cuts, cuts[1:], strict=False) if b > a]
    if not blocks:
        return messages, 0
    split = list(messages)
    split[index] = {**messages[index], "content": blocks}
    return split, len(ends)


def with_prefix_breakpoints(messages: list[dict[str, Any]], stable: list[str], ttl: str) -> list[dict[str, Any]]:
    """KSI's breakpoints where the call says its stable prefix ends: the end of each `stable` part
    the system message opens with (system prompt, newest stored summary) lives `ttl`; the end of
    the system message, the newest reply and the newest message live five minutes, as
    `with_breakpoints` places them. At most four: the end of the system message gives way first
    (the notes there change only when the window moves, and so does all that follows them). The
    longer lifetimes come first (the system comes before the messages), as Anthropic requires. A
    request carrying a client's own markers is sent as it came."""
    if has_markers(messages):
        return messages
    split, frozen = _split_system(messages, stable)
    placed = with_breakpoints(split)
    if frozen:
        index = next(i for i in range(len(placed) - 1, -1, -1) if placed[i].get("role") == "system")
        blocks = [dict(block) for block in placed[index]["content"]]
        for block in blocks[:frozen]:
            block["cache_control"] = lifetime(ttl)
        placed[index] = {**placed[index], "content": blocks}
        if _count(placed) > MAX_BREAKPOINTS and len(blocks) > frozen:
            blocks[-1].pop("cache_control", None)
    return placed


def _count(messages: list[dict[str, Any]]) -> int:
    """The breakpoints a request's messages carry."""
    return sum(1 for m in messages if isinstance(m.get("content"), list)
               for b in m["content"] if isinstance(b, dict) and "cache_control" in b)


# OpenAI's explicit breakpoint (models from gpt-5.6 on): at most four cache writes a request, one of
# them the provider's own implicit one
OPENAI_BREAKPOINT = {"mode": "explicit"}
OPENAI_MAX_BREAKPOINTS = 3


def _blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    content = message.get("content")
    return [{"type": "text", "text": content}] if isinstance(content, str) else [dict(b) for b in content or []]


def has_openai_breakpoints(messages: list[dict[str, Any]]) -> bool:
    """Whether any block of a message carries a client's own prompt_cache_breakpoint."""
    return any(isinstance(m.get("content"), list) and any(isinstance(b, dict) and "prompt_cache_breakpoint" in b
                                                          for b in m["content"]) for m in messages)


def with_openai_breakpoints(messages: list[dict[str, Any]], stable: list[str]) -> list[dict[str, Any]]:
    """KSI's explicit OpenAI breakpoints: the end of each `stable` part the system message opens
    with (or of the whole system message), and the newest message not the assistant's (OpenAI takes
    none on an assistant's output), at most three. A request carrying a client's own is sent as it came."""
    if has_markers(messages) or has_openai_breakpoints(messages):
        return messages
    split, frozen = _split_system(messages, stable)
    placed = list(split)
    system = next((i for i in range(len(placed) - 1, -1, -1) if placed[i].get("role") == "system"), None)
    newest = next((i for i in range(len(placed) - 1, -1, -1) if placed[i].get("role") != "assistant"), None)
    room = OPENAI_MAX_BREAKPOINTS
    for index in dict.fromkeys(i for i in (system, newest) if i is not None):
        if not isinstance(placed[index].get("content"), (str, list)):
            continue
        blocks = _blocks(placed[index])
        ends = range(frozen) if index == system and frozen else range(len(blocks) - 1, len(blocks))
        for end in [e for e in ends if blocks[e].get("type") == "text"][:room]:
            blocks[end]["prompt_cache_breakpoint"] = OPENAI_BREAKPOINT
            room -= 1
        placed[index] = {**placed[index], "content": blocks}
    return placed


def _marks(message: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    """The blocks of `message` carrying a breakpoint (either provider's), with their positions; a
    marker on the message itself (a client's, on text content) counts as its last block's."""
    content = message.get("content")
    blocks = [b for b in content if isinstance(b, dict)] if isinstance(content, list) else []
    found = [(i, b) for i, b in enumerate(blocks) if "cache_control" in b or "prompt_cache_breakpoint" in b]
    if "cache_control" in message:
        found.append((max(len(blocks) - 1, 0), message))
    return found


def _lifetime_of(marked: dict[str, Any]) -> str | None:
    """A marker's lifetime: Anthropic's default five minutes unless it names one; an OpenAI
    explicit breakpoint names none (the provider keeps its cache as it does the implicit one)."""
    marker = marked.get("cache_control")
    if marker is None:
        return None
    return str(marker.get("ttl") or "5m") if isinstance(marker, dict) else "5m"


def _closes(message: dict[str, Any], block: int, stable: list[str]) -> int | None:
    """Which `stable` part the system message's text ends with at the end of `block` (None: none)."""
    content = message.get("content")
    if not isinstance(content, list) or not stable:
        return None
    text = "".join(str(b.get("text", "")) for b in content[:block + 1] if isinstance(b, dict)).rstrip()
    return next((j for j in range(len(stable) - 1, -1, -1) if stable[j] and text.endswith(stable[j].rstrip())), None)


def placed_breakpoints(messages: list[dict[str, Any]], stable: list[str], by: str) -> list[dict[str, Any]]:
    """Where `messages`, as they go to the provider, carry breakpoints: the message's index, its
    lifetime, who placed them (`by`) and, in the system message, which `stable` part one closes."""
    placed: list[dict[str, Any]] = []
    for at, message in enumerate(messages):
        for block, marked in _marks(message):
            point: dict[str, Any] = {"at": at, "ttl": _lifetime_of(marked), "by": by}
            closes = _closes(message, block, stable) if message.get("role") == "system" else None
            if closes is not None:
                point["closes"] = closes
            placed.append(point)
    return placed
