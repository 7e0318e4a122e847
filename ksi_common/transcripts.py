"""Conversations as storage records them: metadata, fork chain, exchanges, stats.

Read-only and client-light, over any backend's `StoredReader`: shared by the daemon's
`conversation:*` events and the `ksi` inspection commands, so both tell the same story.
Torn last lines (a crash mid-append) are skipped by the readers underneath.
"""

from __future__ import annotations

import fnmatch
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.ids import check_id
from ksi_common.items import input_items, item_public, item_text, output_items
from ksi_common.reading import StoredReader
from ksi_common.records import IndexEntry, ResponseRecord
from ksi_common.timefmt import format_ts, parse_ts

DEFAULT_MAX_FORK_DEPTH = 32
STATES = ("active", "archived", "expired")


def _ts(text: Any) -> float | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        return parse_ts(text)
    except ValueError:
        return None


def _state(meta: dict[str, Any], last: float | None, now: float) -> str:
    """active, archived or expired (an active conversation idle longer than its TTL)."""
    if (meta.get("status") or "active") == "archived":
        return "archived"
    ttl = meta.get("ttl")
    if not isinstance(ttl, int | float) or last is None:
        return "active"
    try:
        return "expired" if last + float(ttl) < now else "active"
    except OverflowError:  # a TTL saved before it had an upper bound
        return "active"


def summarize(meta: dict[str, Any], now: float) -> dict[str, Any]:
    """The public description of a conversation from its metadata; `state` adds `expired`."""
    ttl = meta.get("ttl")
    last = _ts(meta.get("last_activity"))
    expires = last + float(ttl) if isinstance(ttl, int | float) and last is not None else None
    expires_at = None
    if expires is not None:
        try:
            expires_at = format_ts(expires)
        except (OverflowError, ValueError, OSError):  # a TTL saved before it had an upper bound
            expires = None
    status = meta.get("status") or "active"
    state = _state(meta, last, now)
    inherited = int(meta.get("fork_at") or 0) if meta.get("parent_id") else 0
    own = int(meta.get("exchanges") or 0)
    return {
        "conversation_id": meta.get("conversation_id"),
        "title": meta.get("title"),
        "tags": list(meta.get("tags") or []),
        "status": status,
        "state": state,
        "agent_id": meta.get("agent_id"),
        "system": meta.get("system"),
        "created": meta.get("created"),
        "last_activity": meta.get("last_activity"),
        "ttl": ttl,
        "expires_at": expires_at,
        "turn_cap": meta.get("turn_cap"),
        "parent_id": meta.get("parent_id"),
        "fork_at": meta.get("fork_at") if meta.get("parent_id") else None,
        "exchanges": own,  # its own exchanges; a fork also shares `inherited` ones with its parent
        "inherited": inherited,
        "turns": inherited + own,
        "origin": meta.get("origin"),  # the door that created it; None for one older than the record
        "preview": meta.get("preview"),  # the start of its first input
        "models": list(meta.get("models") or []),
        "tokens_in": int(meta.get("tokens_in") or 0),
        "tokens_out": int(meta.get("tokens_out") or 0),
        # key-value pairs a client attached (the Conversations API's `metadata`)
        "metadata": dict((meta.get("extra") or {}).get("metadata") or {}),
        "cost": float(meta.get("cost") or 0.0),
        "external_ids": dict((meta.get("extra") or {}).get("external_ids") or {}),
        # user messages a client added that have no reply yet (the next request takes them first)
        "pending_input": list((meta.get("extra") or {}).get("pending_input") or []),
        "pins": [int(n) for n in meta.get("pins") or [] if isinstance(n, int)],
    }


def _reported(reply: dict[str, Any] | None, key: str, counted: int) -> int:
    """The provider's count from the reply's usage, else KSI's own (a provider that reported none)."""
    value = ((reply or {}).get("usage") or {}).get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else counted


def exchange_view(entry: IndexEntry, record: ResponseRecord | None, owner: str, inherited: bool) -> dict[str, Any]:
    """One exchange for show and export: its index line, its input lines (who sent each and when,
    the files read for it), its reply, and what it took in and gave out as items.

    `inputs[i]` and `input[i]` describe the same record line; a record written before items reads
    as one user message in and one assistant message out. References are shown, never bytes."""
    inputs = []
    input_list: list[dict[str, Any]] = []
    for line in record.inputs if record is not None else []:
        found = input_items([line])
        if not found:
            continue
        item: dict[str, Any] = {"type": line.get("type"), "content": line.get("content"), "ts": line.get("ts")}
        for key in ("from_agent", "files", "agent_id"):
            if line.get(key):
                item[key] = line[key]
        inputs.append(item)
        input_list.append(item_public(found[0]))
    reply = None
    output_list: list[dict[str, Any]] = []
    if record is not None and record.ok and record.outcome is not None:
        outcome = record.outcome
        reply = {key: outcome.get(key) for key in
                 ("content", "model", "provider", "finish_reason", "usage", "cost", "duration_ms", "ts")}
        if outcome.get("cost_uncached") is not None:  # recorded only when the provider used its cache
            reply["cost_uncached"] = outcome["cost_uncached"]
        output_list = [item_public(item) for item in output_items(outcome)]
    view: dict[str, Any] = {
        "n": entry.n,
        "conversation_id": owner,
        "inherited": inherited,
        "response_id": entry.response_id,
        "ts": entry.ts,
        "model": entry.model,
        "provider": entry.provider,
        "agent_id": entry.agent_id,
        # the provider's counts, as the reply's usage and the conversation's totals have them;
        # KSI's own count of what the exchange costs in a later turn's history is apart
        "tokens_in": _reported(reply, "prompt_tokens", entry.tokens_in),
        "tokens_out": _reported(reply, "completion_tokens", entry.tokens_out),
        "history_tokens": {"in": entry.tokens_in, "out": entry.tokens_out},
        "is_feedback": entry.is_feedback,
        "inputs": inputs,
        "reply": reply,
        "input": input_list,
        "output": output_list,
    }
    if entry.run_id:
        view["run_id"] = entry.run_id  # the consortium run that produced this exchange
    if reply is None:
        view["incomplete"] = True  # the response file is missing or its outcome line is torn
    return view


def exchange_items(exchange: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """An exchange's input lines with their items (one each, in order) and its output items; an
    exchange of a document made before items has its items read from its lines and reply."""
    lines = [line for line in exchange.get("inputs") or [] if isinstance(line, dict)]
    given = exchange.get("input")
    if isinstance(given, list) and len(given) == len(lines):
        inputs = [item for item in given if isinstance(item, dict)]
    else:
        inputs = [item_public(item) for item in input_items(lines)]
    if len(inputs) != len(lines):  # lines of kinds no item stands for: shown without metadata
        lines = [{} for _item in inputs]
    output = exchange.get("output")
    if not isinstance(output, list):
        reply = exchange.get("reply")
        output = output_items({**reply, "type": "assistant"}) if isinstance(reply, dict) else []
    return lines, inputs, [item for item in output if isinstance(item, dict)]


def _hit_rate(read: int, prompt: int) -> float | None:
    return round(read / prompt, 4) if prompt else None


def cache_use(exchanges: list[dict[str, Any]]) -> dict[str, Any]:
    """Prompt-cache reads and writes the providers reported: in all, per turn and per model; a hit
    rate is the share of the prompt's tokens read from the cache. Each also has its cost and what
    the same tokens would have cost with no cache (`cost_uncached`, the cost itself when none was used)."""
    turns: list[dict[str, Any]] = []
    models: dict[str, dict[str, Any]] = {}
    for exchange in exchanges:
        reply = exchange.get("reply") or {}
        usage = reply.get("usage") or {}
        prompt = int(usage.get("prompt_tokens") or 0)
        read = int(usage.get("cache_read_input_tokens") or 0)
        created = int(usage.get("cache_creation_input_tokens") or 0)
        cost = float(reply.get("cost") or 0.0)
        uncached = float(reply.get("cost_uncached") or cost)
        turns.append({"n": exchange.get("n"), "model": exchange.get("model"), "prompt_tokens": prompt,
                      "read": read, "created": created, "hit_rate": _hit_rate(read, prompt),
                      "cost": cost, "cost_uncached": uncached})
        per_model = models.setdefault(str(exchange.get("model")), {"prompt_tokens": 0, "read": 0, "created": 0,
                                                                   "cost": 0.0, "cost_uncached": 0.0})
        for key in ("prompt_tokens", "read", "created", "cost", "cost_uncached"):
            per_model[key] += turns[-1][key]
    for per_model in models.values():
        per_model["hit_rate"] = _hit_rate(per_model["read"], per_model["prompt_tokens"])
        for key in ("cost", "cost_uncached"):
            per_model[key] = round(per_model[key], 10)
    prompt_total = sum(t["prompt_tokens"] for t in turns)
    read_total = sum(t["read"] for t in turns)
    return {"read": read_total, "created": sum(t["created"] for t in turns),
            "hit_rate": _hit_rate(read_total, prompt_total), "models": models, "turns": turns,
            "cost": round(sum(t["cost"] for t in turns), 10),
            "cost_uncached": round(sum(t["cost_uncached"] for t in turns), 10)}


def stats_of(transcript: dict[str, Any]) -> dict[str, Any]:
    """Counts, tokens, cost, models, agents, files and duration of a transcript's own exchanges."""
    exchanges = transcript["exchanges"]
    own = [x for x in exchanges if not x["inherited"]]
    models: dict[str, int] = {}
    agents: dict[str, int] = {}
    files: dict[str, int] = {}
    tokens_in = tokens_out = 0
    cost = 0.0
    for exchange in own:
        reply = exchange.get("reply") or {}
        usage = reply.get("usage") or {}
        tokens_in += int(usage.get("prompt_tokens") or 0)
        tokens_out += int(usage.get("completion_tokens") or 0)
        cost += float(reply.get("cost") or 0.0)
        if exchange.get("model"):
            models[exchange["model"]] = models.get(exchange["model"], 0) + 1
        if exchange.get("agent_id"):
            agents[exchange["agent_id"]] = agents.get(exchange["agent_id"], 0) + 1
        for item in exchange["inputs"]:
            for ref in item.get("files") or []:
                if isinstance(ref, dict) and ref.get("path"):
                    files[ref["path"]] = files.get(ref["path"], 0) + 1
    moments = [t for t in (_ts(x.get("ts")) for x in own) if t is not None]
    first, last = (min(moments), max(moments)) if moments else (None, None)
    summaries = transcript.get("summaries") or []
    compaction = {
        "summaries": len(summaries),
        "exchanges_covered": max((int(x["upto"]) for x in summaries), default=0),
        "tokens_in": sum(int((x.get("usage") or {}).get("prompt_tokens") or 0) for x in summaries),
        "tokens_out": sum(int((x.get("usage") or {}).get("completion_tokens") or 0) for x in summaries),
        "cost": sum(float(x.get("cost") or 0.0) for x in summaries),
        "fallbacks": sum(1 for x in summaries if x.get("kind") == "fallback"),
        # per summary: what it covers, whether the fallback stood in, and the checks that decided it
        "parts": [{"conversation_id": x.get("conversation_id"), "first": int(x.get("first") or 1),
                   "upto": int(x["upto"]), "kind": x.get("kind") or "summary", "level": int(x.get("level") or 0),
                   "fallback": x.get("kind") == "fallback", "tokens": int(x.get("tokens") or 0),
                   "model": x.get("model"), "checks": x.get("checks") or {}} for x in summaries],
    }
    return {
        "compaction": compaction,
        "cache": cache_use(own),
        "conversation_id": transcript["conversation"]["conversation_id"],
        "exchanges": len(exchanges),
        "own_exchanges": len(own),
        "inherited_exchanges": len(exchanges) - len(own),
        "feedback_exchanges": sum(1 for x in own if x.get("is_feedback")),
        "incomplete_exchanges": sum(1 for x in own if x.get("incomplete")),
        "tokens_in": tokens_in,
        "tokens_out": tokens_out,
        "cost": round(cost, 10),
        "models": models,
        "agents": agents,
        "files": files,
        "first": format_ts(first) if first is not None else None,
        "last": format_ts(last) if last is not None else None,
        "duration_s": round(last - first, 3) if first is not None and last is not None else 0.0,
    }


T = TypeVar("T")


def _meta_link(meta: dict[str, Any]) -> tuple[str | None, int | None]:
    fork_at = meta.get("fork_at")
    return (str(meta["parent_id"]) if meta.get("parent_id") else None,
            int(fork_at) if fork_at is not None else None)


async def fork_chain(
    conversation_id: str, start: T, link: Callable[[T], tuple[str | None, int | None]],
    load: Callable[[str], Awaitable[T | None]], max_depth: int,
) -> tuple[list[tuple[T, int | None]], str | None]:
    """A conversation and its ancestors (self first), each with the last exchange it contributes,
    and the id of a parent that no longer exists when the chain breaks there.

    The one walk of a fork chain, over metadata (inspection) or conversations in memory (history):
    `link` gives an item's (parent id, fork point), `load` finds a parent. A fork of a fork at k
    shares at most exchanges 1..k of every ancestor; a loop or a chain deeper than `max_depth`
    is `fork_cycle`.
    """
    chain: list[tuple[T, int | None]] = [(start, None)]
    seen = {conversation_id}
    limit: int | None = None
    current = start
    while True:
        parent_id, fork_at = link(current)
        if not parent_id:
            return chain, None
        upto = fork_at if limit is None else (limit if fork_at is None else min(fork_at, limit))
        if parent_id in seen or len(chain) > max_depth:
            raise KsiError(ErrorCode.FORK_CYCLE, "the fork chain loops or is too deep",
                           conversation_id=conversation_id, at=parent_id)
        seen.add(parent_id)
        parent = await load(parent_id)
        if parent is None:
            return chain, parent_id
        chain.append((parent, upto))
        limit = upto
        current = parent


class Transcripts:
    """Fork chains, transcripts and listings over any backend's reader; every method is a coroutine."""

    def __init__(self, reader: StoredReader, max_fork_depth: int = DEFAULT_MAX_FORK_DEPTH) -> None:
        self.reader = reader
        self.max_fork_depth = max_fork_depth
        # metadata by conversation, with the (mtime, size) it was read at: a long-lived reader
        # (the daemon's) lists 10,000 conversations by stat-ing their files, not re-reading them
        self._listed: dict[str, tuple[tuple[int, int, int], dict[str, Any], float]] = {}
        self._listed_stamp: tuple[int, int] = (0, 0)  # mtimes of the metadata and index directories
        self._listed_all: list[tuple[dict[str, Any], float]] | None = None

    async def meta(self, conversation_id: str) -> dict[str, Any] | None:
        """The metadata as stored; an index without metadata gets a minimal record."""
        check_id(conversation_id, "conversation_id")
        (meta,) = await self.reader.metas([conversation_id])
        return meta

    async def require_meta(self, conversation_id: str) -> dict[str, Any]:
        meta = await self.meta(conversation_id)
        if meta is None:
            raise KsiError(ErrorCode.CONVERSATION_NOT_FOUND, f"conversation {conversation_id} does not exist",
                           conversation_id=conversation_id)
        return meta

    async def response(self, response_id: str) -> ResponseRecord | None:
        check_id(response_id, "response_id")
        (record,) = await self.reader.responses([response_id])
        return record

    # -- fork chains and transcripts ----------------------------------------
    async def chain(self, conversation_id: str) -> tuple[list[tuple[str, dict[str, Any], int | None]], str | None]:
        """The conversation and its ancestors (self first), each with the last exchange it
        contributes, and the id of a parent that no longer exists (if the chain breaks)."""
        meta = await self.require_meta(conversation_id)

        async def parent(parent_id: str) -> tuple[str, dict[str, Any]] | None:
            try:
                found = await self.meta(parent_id)
            except KsiError:  # an id that cannot name a conversation: the chain breaks there
                return None
            return (parent_id, found) if found is not None else None

        links, missing = await fork_chain(conversation_id, (conversation_id, meta),
                                          lambda item: _meta_link(item[1]), parent, self.max_fork_depth)
        return [(owner, owner_meta, upto) for (owner, owner_meta), upto in links], missing

    async def transcript(self, conversation_id: str, inherited: bool = True,
                         now: float | None = None) -> dict[str, Any]:
        """Metadata and every exchange, oldest first; inherited ones (from the fork chain) marked."""
        chain, missing_parent = await self.chain(conversation_id) if inherited else (
            [(conversation_id, await self.require_meta(conversation_id), None)], None)
        picked: list[tuple[str, IndexEntry]] = []
        for owner, _meta, upto in reversed(chain):
            for entry in await self.reader.entries(owner):
                if upto is not None and entry.n > upto:
                    break
                picked.append((owner, entry))
        records = await self.reader.responses([entry.response_id for _owner, entry in picked])
        exchanges = [exchange_view(entry, record, owner, owner != conversation_id)
                     for (owner, entry), record in zip(picked, records, strict=True)]
        summary = summarize(chain[0][1], time.time() if now is None else now)
        transcript: dict[str, Any] = {"conversation": summary, "exchanges": exchanges}
        if missing_parent:
            transcript["missing_parent"] = missing_parent
        summaries = await self.summaries_of(chain)
        if summaries:
            transcript["summaries"] = summaries
        return transcript

    async def summaries_of(self, chain: list[tuple[str, dict[str, Any], int | None]]) -> list[dict[str, Any]]:
        """The summaries a conversation may use: its own, and each ancestor's that covers only the
        prefix the fork shares; oldest coverage first."""
        found = []
        for owner, _meta, upto in chain:
            for summary in await self.reader.summaries(owner):
                if upto is None or summary.upto <= upto:
                    found.append({**summary.to_record(), "type": "summary"})
        return sorted(found, key=lambda s: (s["upto"], s["ts"] or ""))

    # -- listing ------------------------------------------------------------
    async def listing(
        self,
        now: float | None = None,
        *,
        agent_id: str | None = None,
        model: str | None = None,
        status: str | None = None,
        tag: str | None = None,
        text: str | None = None,
        since: str | None = None,
        limit: int | None = None,
        offset: int = 0,
    ) -> tuple[list[dict[str, Any]], int]:
        """Summaries matching every given filter, newest activity first, and how many matched."""
        now = time.time() if now is None else now
        since_ts = _ts(since) if since else None
        matched: list[tuple[float, str, dict[str, Any]]] = []
        for meta in await self.reader.all_metas():
            conversation_id = str(meta["conversation_id"])
            last = _ts(meta.get("last_activity")) or 0.0
            if status and status not in (meta.get("status") or "active", _state(meta, last, now)):
                continue
            if tag and tag not in (meta.get("tags") or ()):
                continue
            if model and not any(fnmatch.fnmatchcase(m, model) for m in meta.get("models") or ()):
                continue
            if since_ts is not None and last < since_ts:
                continue
            if agent_id and meta.get("agent_id") != agent_id and not any(
                    e.agent_id == agent_id for e in await self.reader.entries(conversation_id)):
                continue
            if text and text.casefold() not in (meta.get("title") or "").casefold() \
                    and not await self._contains(conversation_id, text):
                continue
            matched.append((last, conversation_id, meta))
        matched.sort(key=lambda found: (found[0], found[1]), reverse=True)
        end = None if limit is None else offset + limit
        return [summarize(meta, now) for _last, _id, meta in matched[offset:end]], len(matched)

    async def _contains(self, conversation_id: str, text: str) -> bool:
        """Whether any input or reply of the conversation's own exchanges contains `text`."""
        needle = text.casefold()
        entries = await self.reader.entries(conversation_id)
        for record in await self.reader.responses([e.response_id for e in entries]):
            if record is None:
                continue
            texts: Iterable[str] = [item_text(item) for item in [*input_items(record.inputs),
                                                                   *output_items(record.outcome)]]
            if any(needle in t.casefold() for t in texts):
                return True
        return False
