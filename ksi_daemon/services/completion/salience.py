"""What a summary must keep, found without a model: the salient items of exchanges, the checks a
summariser's candidate passes before it is stored, and the fallback that stands in without one.

Items are strings found in the text itself (names, numbers, dates, identifiers, paths, URLs,
quoted strings) and, for what the user wrote, the sentences in which they speak about themselves,
their goals and their decisions. A candidate keeps an item when the item's words are in it, so a
summary may rephrase a sentence as long as its content words survive.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from ksi_common.items import item_text
from ksi_daemon.services.conversations.memory import Exchange
from ksi_daemon.services.conversations.salient import Items

EXCHANGE_TEXT_LIMIT = 8000  # characters of one exchange's texts a summariser is shown (and searched for items)
ITEM_CHARS = 160  # one item is cut to this many characters
USER_INPUT_CHARS = 400  # one user input, as the fallback shows it
MIN_KEPT_SHARE = 0.9  # a candidate that keeps fewer of its input's items is not used
DIGEST_ITEMS = 40  # a summary cut to its salient items keeps at most this many
# what summaries and fallbacks add around their content: exchange numbers, list marks, headings
_MARKUP = re.compile(r"^(?:\s*(?:[-*#>]+\s*|\[\d+\] (?:User|Assistant): |Summary of exchanges [\d-]+:|"
                     r"The user said: |Items named: ))+", re.MULTILINE)

_URL = r"https?://[^\s<>\"')\]]+"
_PATH = r"(?<![\w/])(?:~|\.{1,2})?/(?:[\w.@%+-]+/)*[\w.@%+-]+"
_FILE = r"\b[\w-]+\.(?:py|js|ts|json|jsonl|md|txt|csv|yaml|yml|toml|sql|sh|html|css|rs|go|c|h|cpp|java)\b"
_EMAIL = r"\b[\w.+-]+@[\w-]+\.[\w.-]+\b"
_DATE = (r"\b\d{4}-\d{2}-\d{2}\b|\b\d{1,2}/\d{1,2}/\d{2,4}\b|"
         r"\b(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec)[a-z]*\.? \d{1,2}(?:st|nd|rd|th)?(?:,? \d{4})?\b")
_IDENT = (r"\b(?=[\w-]*\d)(?=[\w-]*[A-Za-z])[\w]+(?:[-_][\w]+)+\b|\b[a-z]+_[a-z_]+\b|"
          r"\b(?=\w*\d)(?=\w*[A-Za-z])\w{2,}\b")  # ids with dashes, snake_case, letters and digits mixed
_NUMBER = r"(?<![\w.])[$€£]?\d+(?:[.,:]\d+)*%?(?![\w.])"
_QUOTED = r"\"([^\"\n]{2,80})\"|“([^”\n]{2,80})”"
_NAME = r"\b[A-Z][a-z]+(?:[ -][A-Z][a-z]+)*\b"
_CALL = r"\[call [\w-]+\([^\n]{0,120}?\) id=[^\]\s]*\]"  # a tool call as ksi_common.items.item_text shows it
_PATTERNS = [re.compile(p) for p in (_CALL, _URL, _EMAIL, _PATH, _FILE, _DATE, _IDENT, _NUMBER)]
_QUOTE_RE = re.compile(_QUOTED)
_NAME_RE = re.compile(_NAME)
_SENTENCE_RE = re.compile(r"[^.!?\n]+[.!?]?")
_WORD_RE = re.compile(r"[\w'$€£%.-]+")
# a capitalised word that starts a sentence or is one of these is not taken for a name
_NOT_NAMES = frozenset("""I I'm I've I'd I'll A An The This That These Those It Its My Our We You Your He She They
Yes No Ok Okay Please Thanks Thank Hi Hello Hey Sure What Which Who Whom Whose When Where Why How Can Could Would
Should Will Shall May Might Must Do Does Did Is Are Was Were Be Been Let Also And But Or So If Then Now Here There
Just Not Note User Assistant Summary Exchanges Exchange Facts Decisions Open Tool Files Who""".split())
# what marks a user's sentence about themselves, their goals or their decisions
_ABOUT_SELF = re.compile(
    r"\b(?:i|i'm|i've|i'd|i'll|im|my|me|mine|we|we're|we've|our|us|let's)\b|"
    r"\b(?:decided|decide|decision|chose|choose|prefer|want|need|goal|plan|going to|must|always|never)\b",
    re.IGNORECASE)
_STOP = frozenset("""the a an and or but of to in on at for with from by is are was were be been am i my me we our
us you your it its this that these those have has had do does did will would should could can not no so as if then
than about into over under also just very really more most some any all let's im i'm i've i'd i'll".""".split())
_REFUSAL = re.compile(
    r"\b(?:i apologi[sz]e|i'm sorry|i am sorry|sorry, but|i cannot|i can't|i can not|i'm unable|i am unable|"
    r"as an ai|need more (?:information|context)|could you (?:please )?(?:provide|clarify|share)|"
    r"please provide|i don't have (?:enough|access))\b", re.IGNORECASE)


def _clip(text: str, limit: int = ITEM_CHARS) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 1].rstrip() + "…"


def _names(text: str) -> list[str]:
    found = []
    for sentence in _SENTENCE_RE.findall(text):
        stripped = sentence.lstrip(" \t\"'([*-#>:")
        start = len(sentence) - len(stripped)
        for match in _NAME_RE.finditer(sentence):
            words = match.group(0).split()
            if match.start() <= start:  # the sentence's first word: capitalised anyway
                words = words[1:]
            while words and words[0] in _NOT_NAMES:
                words = words[1:]
            if words and (len(words) > 1 or len(words[0]) > 2):
                found.append(" ".join(words))
    return found


def salient_items(text: str) -> list[str]:
    """The tool calls, names, numbers, dates, identifiers, paths, URLs and quoted strings of `text`, in order."""
    found: list[tuple[int, str]] = []
    covered = bytearray(len(text) + 1)  # 1 where an item found so far lies: a lookup per match

    def add(start: int, end: int, value: str) -> None:
        if covered[start] or (end > start and covered[end - 1]):
            return  # inside a longer item already found (a path's digits, a URL's host)
        covered[start:end] = b"\x01" * (end - start)
        found.append((start, _clip(value)))

    for match in _QUOTE_RE.finditer(text):
        add(match.start(), match.end(), match.group(1) or match.group(2))
    for pattern in _PATTERNS:
        for match in pattern.finditer(text):
            add(match.start(), match.end(), match.group(0).rstrip(".,;:"))
    seen: set[str] = {value.lower() for _start, value in found}
    items = [value for _start, value in sorted(found)]
    for name in _names(text):
        if name.lower() not in seen and not any(name in item for item in items):
            items.append(name)
            seen.add(name.lower())
    return list(dict.fromkeys(items))


def self_statements(text: str) -> list[str]:
    """The user's sentences about themselves, their goals and their decisions (not questions)."""
    found = []
    for sentence in _SENTENCE_RE.findall(text):
        sentence = sentence.strip()
        if len(sentence) < 8 or sentence.endswith("?") or not _ABOUT_SELF.search(sentence):
            continue
        if len(content_words(sentence)) < 2:
            continue
        found.append(_clip(sentence))
    return found


def content_words(text: str) -> list[str]:
    words = [w.strip(".,;:!?\"'()").lower() for w in _WORD_RE.findall(text)]
    return [w for w in words if w and w not in _STOP and (len(w) > 2 or any(c.isdigit() for c in w))]


def exchange_salience(exchange: Exchange) -> Items:
    """One exchange's items, found once and kept with it (an exchange never changes once stored;
    a reset, delete or move drops the conversation's exchanges from memory, and these with them)."""
    if exchange.salient is not None:
        return exchange.salient
    items = Items()
    # clipped as the summariser is shown them: it cannot keep what it never saw
    for item in exchange.input:
        text = item_text(item)[:EXCHANGE_TEXT_LIMIT]
        if item.get("type") == "message":
            items.user.extend(self_statements(text))
        items.facts.extend(salient_items(text))
    for item in exchange.output:
        if item.get("type") == "function_call":  # a summary says which tools were called
            items.facts.append(_clip(item_text(item)))
        elif item.get("type") != "reasoning":
            items.facts.extend(salient_items(item_text(item)[:EXCHANGE_TEXT_LIMIT]))
    exchange.salient = items
    return items


def exchange_items(exchanges: list[Exchange]) -> Items:
    """The items of a range of exchanges, in order, each once."""
    user: list[str] = []
    facts: list[str] = []
    for exchange in exchanges:
        found = exchange_salience(exchange)
        user.extend(found.user)
        facts.extend(found.facts)
    return Items(user=list(dict.fromkeys(user)), facts=list(dict.fromkeys(facts)))


def text_items(text: str) -> Items:
    """The items of a summary's text (what a merge of summaries must keep)."""
    return Items(user=self_statements(text), facts=salient_items(text))


def _normal(text: str) -> str:
    return " ".join(text.lower().replace("’", "'").split())


def kept(item: str, normal: str) -> bool:
    """Whether a candidate, `normal` as _normal makes it, keeps `item`: verbatim, or (for a
    sentence) most of its content words."""
    if _normal(item).rstrip("….") in normal:
        return True
    words = content_words(item)
    if len(words) < 3:
        return all(w in normal for w in words) if words else True
    present = sum(1 for w in words if w in normal)
    return present >= max(2, round(len(words) * 0.6))


@dataclass(slots=True)
class Verdict:
    """A candidate's checks: `ok`, or why not, and which items it dropped."""

    ok: bool
    reasons: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    items: int = 0
    tokens: int = 0
    limit: int = 0

    def to_record(self) -> dict[str, object]:
        record: dict[str, object] = {"ok": self.ok, "items": self.items, "kept": self.items - len(self.missing),
                                     "tokens": self.tokens, "limit": self.limit}
        if self.reasons:
            record["reasons"] = self.reasons
        if self.missing:
            record["missing"] = self.missing[:20]
        return record


def check_candidate(candidate: str, items: Items, source_tokens: int, limit: int,
                    count_tokens: Callable[[str], int]) -> Verdict:
    """Whether a summariser's answer may stand for its input: not a refusal or a question back,
    not longer than what it covers nor than its share of the budget (`limit`), and keeping at
    least MIN_KEPT_SHARE of the input's items (every one of the user's own statements counts)."""
    text = candidate.strip()
    tokens = count_tokens(text) if text else 0
    verdict = Verdict(ok=True, items=len(items.all()), tokens=tokens, limit=limit)
    if not text:
        verdict.reasons.append("empty")
    elif _REFUSAL.search(text[:400]):
        verdict.reasons.append("refusal")
    elif text.rstrip().endswith("?") and len(content_words(text)) < 60:
        verdict.reasons.append("question")
    if tokens > source_tokens:
        verdict.reasons.append("longer_than_input")
    if tokens > limit:
        verdict.reasons.append("over_budget")
    normal = _normal(text)  # once, not once per item
    verdict.missing = [item for item in items.all() if not kept(item, normal)]
    if verdict.items and len(verdict.missing) > verdict.items * (1 - MIN_KEPT_SHARE):
        verdict.reasons.append("dropped_items")
    verdict.ok = not verdict.reasons
    return verdict


def fallback_text(exchanges: list[tuple[int, Exchange]], limit: int, count_tokens: Callable[[str], int],
                  inputs: bool = True, items: Items | None = None) -> str:
    """What stands in for exchanges without a usable summary: the salient items of the whole range
    first (the user's own statements, then names, numbers, ...), then (`inputs`) each user input,
    shortened, newest first, as far as `limit` tokens allow. `items`: those of `exchanges`, when
    the caller found them already."""
    if items is None:
        items = exchange_items([exchange for _n, exchange in exchanges])
    lines: list[str] = []
    used = 0

    def add(line: str) -> bool:
        nonlocal used
        cost = count_tokens(line) + 1
        if used + cost > limit:
            return False
        lines.append(line)
        used += cost
        return True

    if items.user:
        add("The user said: " + " | ".join(items.user[:1]))
        for statement in items.user[1:]:
            if not add(f"- {statement}"):
                break
    facts = [fact for fact in items.facts if not any(fact in statement for statement in items.user)]
    if facts:
        add("Items named: " + "; ".join(facts[:1]))
        for fact in facts[1:]:
            if not add(f"- {fact}"):
                break
    for n, exchange in reversed(exchanges if inputs else []):
        for item in exchange.input:
            room = (limit - used - 8) * 3  # characters: a shortened input where a whole one no longer fits
            if room < 40:
                return "\n".join(lines)
            who = "Tool" if item.get("type") == "function_call_output" else "User"
            add(f"[{n}] {who}: {_clip(item_text(item), min(USER_INPUT_CHARS, room))}")
    return "\n".join(lines)


def digest(text: str, limit: int, count_tokens: Callable[[str], int]) -> str:
    """The salient items of a summary's text (the user's statements first, then the items they do
    not already hold), in order, within `limit` tokens."""
    text = _MARKUP.sub("", text)
    statements = self_statements(text)
    items = [*statements, *(i for i in salient_items(text) if not any(i in s for s in statements))]
    lines: list[str] = []
    used = 0
    for item in list(dict.fromkeys(items))[:DIGEST_ITEMS]:
        cost = count_tokens(item) + 2
        if used + cost > limit:
            continue  # a shorter one further on may still fit
        lines.append(f"- {item}")
        used += cost
    return "\n".join(lines)
