"""`conversation:*` events: list, show, stats, export and import conversations; fork, update,
archive and delete them.

Reading goes through `ksi_common.transcripts` over the conversation store (the same code
`ksi conversation ...` runs with the daemon stopped); writing goes through the conversation
writer (`writer.py`), as every service's does. Metadata changes happen under the conversation's
lock, the one a completion holds while it commits an exchange, so neither overwrites the other's
change.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.events import (
    CONVERSATION_ABANDON_CALLS,
    CONVERSATION_APPEND,
    CONVERSATION_ARCHIVE,
    CONVERSATION_CHANGED,
    CONVERSATION_DELETE,
    CONVERSATION_EXPORT,
    CONVERSATION_FORK,
    CONVERSATION_IMPORT,
    CONVERSATION_LIST,
    CONVERSATION_PEND,
    CONVERSATION_PIN,
    CONVERSATION_SENT,
    CONVERSATION_SHOW,
    CONVERSATION_STATS,
    CONVERSATION_UNPIN,
    CONVERSATION_UPDATE,
    RESPONSE_DELETE,
    RESPONSE_SHOW,
    ConversationChanged,
)
from ksi_common.export import parse_export, render
from ksi_common.ids import new_id, new_response_id
from ksi_common.items import ABANDONED_OUTPUT, call_ids_answered, canonical_text, item_text
from ksi_common.records import IndexEntry
from ksi_common.settings import Settings
from ksi_common.timefmt import format_ts
from ksi_common.transcripts import Transcripts, stats_of, summarize
from ksi_daemon.context import EventContext
from ksi_daemon.router import Router, Unregister
from ksi_daemon.services.conversations.added_items import added_items, check_open_calls, not_held
from ksi_daemon.services.conversations.adoption import (
    MADE_FOR_RUN,
    adopted_meta,
    candidates,
    exchange_items,
    may_take_over,
    repeats,
)
from ksi_daemon.services.conversations.client_items import normalised
from ksi_daemon.services.conversations.digests import fork_point_digest, record_chain
from ksi_daemon.services.conversations.history import fork_chain, open_calls
from ksi_daemon.services.conversations.image_tokens import image_tokens
from ksi_daemon.services.conversations.imported_items import ExchangeItems, checked_items, imported_lines
from ksi_daemon.services.conversations.imports import (
    ImportedDocument,
    ImportedExchange,
    ImportedReply,
    checked_document,
)
from ksi_daemon.services.conversations.memory import ConversationCache, ConversationMemory, Exchange
from ksi_daemon.services.conversations.models import (
    AppendedExchange,
    ConversationAbandonCalls,
    ConversationAppend,
    ConversationArchive,
    ConversationDelete,
    ConversationExport,
    ConversationFork,
    ConversationImport,
    ConversationList,
    ConversationPend,
    ConversationPin,
    ConversationSent,
    ConversationShow,
    ConversationStats,
    ConversationUpdate,
    ResponseRef,
)
from ksi_daemon.services.conversations.pending import pended, pending_items, pending_of
from ksi_daemon.services.conversations.response_lines import answer_line, item_line
from ksi_daemon.services.conversations.responses import locate, previous_of
from ksi_daemon.services.conversations.sent import rebuild_sent
from ksi_daemon.services.conversations.writer import ConversationWriter, NewExchange
from ksi_daemon.storage.models import ConversationMeta, preview_of
from ksi_daemon.storage.ports import BlobStore, ConversationExists

log = structlog.get_logger("ksi.conversation")
IMPORTED_ON_THE_LOOP = 200  # exchanges of an import checked and built on the loop; more go to a thread

CancelRequests = Callable[[str], Awaitable[int]]
# (conversation) -> the tokens its pinned exchanges may take in a turn of its current model
PinsBudget = Callable[[ConversationMeta], Awaitable[int]]


async def _no_pin_limit(_meta: ConversationMeta) -> int:
    return 1 << 30


async def _no_requests(_conversation_id: str) -> int:
    return 0


def system_at(meta: ConversationMeta, at: int) -> str | None:
    """The system prompt in force after exchange `at` (what a fork made there starts with)."""
    changes = [c for c in meta.system_changes if c.from_n <= at]
    if changes:
        return changes[-1].system
    return meta.system if not meta.system_changes else None


class ConversationService:
    def __init__(
        self,
        settings: Settings,
        router: Router,
        cache: ConversationCache,
        writer: ConversationWriter,
        blobs: BlobStore,
        clock: Callable[[], float] = time.time,
        cancel_requests: CancelRequests = _no_requests,
        calibration: Callable[[list[str]], dict[str, Any]] = lambda _models: {},
        pins_budget: PinsBudget = _no_pin_limit,
    ) -> None:
        self.pins_budget = pins_budget
        self.calibration = calibration  # model -> learned token-count ratio, for stats
        self.settings = settings
        self.router = router
        self.cache = cache
        self.writer = writer  # every change of a conversation is written through it
        self.blobs = blobs
        self.responses = cache.responses
        self.clock = clock
        self.cancel_requests = cancel_requests
        self.reader = Transcripts(writer.reader, settings.max_fork_depth)

    def register(self) -> list[Unregister]:
        r = self.router
        return [
            r.register(CONVERSATION_LIST, self.handle_list, ConversationList,
                       "Conversations matching filters, most recently active first, a page at a time."),
            r.register(CONVERSATION_SHOW, self.handle_show, ConversationShow,
                       "A conversation's metadata and exchanges (each with its input and output items); those "
                       "shared with its fork chain are marked inherited."),
            r.register(CONVERSATION_SENT, self.handle_sent, ConversationSent,
                       "What the model was sent for one exchange: system and notes, history shown, input, files, "
                       "its prompt-cache breakpoints and where it first differed from the exchange before."),
            r.register(CONVERSATION_STATS, self.handle_stats, ConversationStats,
                       "Exchanges, tokens, cost, models, agents, files and duration of a conversation."),
            r.register(CONVERSATION_UPDATE, self.handle_update, ConversationUpdate,
                       "Change a conversation's title, tags, TTL, turn cap or status."),
            r.register(CONVERSATION_ARCHIVE, self.handle_archive, ConversationArchive,
                       "Archive a conversation: it refuses new requests until set active again."),
            r.register(CONVERSATION_PIN, self.handle_pin, ConversationPin,
                       "Keep exchanges verbatim in every turn's history, within their share of the budget."),
            r.register(CONVERSATION_UNPIN, self.handle_unpin, ConversationPin,
                       "Let pinned exchanges be left out (or summarised) like any other again."),
            r.register(CONVERSATION_FORK, self.handle_fork, ConversationFork,
                       "A new conversation sharing the history up to an exchange, without copying it."),
            r.register(CONVERSATION_EXPORT, self.handle_export, ConversationExport,
                       "A conversation as markdown, json or jsonl."),
            r.register(CONVERSATION_IMPORT, self.handle_import, ConversationImport,
                       "A new conversation from a json or jsonl export (its exchanges and their items checked "
                       "whole before anything is written), with fresh response ids."),
            r.emits(CONVERSATION_CHANGED),
            r.register(CONVERSATION_DELETE, self.handle_delete, ConversationDelete,
                       "Delete a conversation's index, metadata and response files, and nothing else."),
            r.register(CONVERSATION_APPEND, self.handle_append, ConversationAppend,
                       "Add exchanges (user inputs with their reply) at the end of a conversation, uncalled."),
            r.register(CONVERSATION_PEND, self.handle_pend, ConversationPend,
                       "Hold user messages without a reply; the next request in the conversation takes them first."),
            r.register(CONVERSATION_ABANDON_CALLS, self.handle_abandon_calls, ConversationAbandonCalls,
                       "Give up calls the newest exchange left open: each gets a stored stand-in output, so the "
                       "next turn is a plain one and the model sees a stand-in for their arguments."),
            r.register(RESPONSE_SHOW, self.handle_response_show, ResponseRef,
                       "One response: its inputs, outcome, and its place in its conversation."),
            r.register(RESPONSE_DELETE, self.handle_response_delete, ResponseRef,
                       "Delete one response (refused: a response stays while its conversation does)."),
        ]

    def _changed(self, conversation_id: str, change: str, context: EventContext) -> None:
        """Tell listeners (MCP resource subscriptions, monitors) a conversation changed, once it has."""
        self.router.emit(CONVERSATION_CHANGED, ConversationChanged(conversation_id=conversation_id, change=change),
                         context.child())

    def _summary(self, meta: ConversationMeta) -> dict[str, Any]:
        return summarize(meta.model_dump(mode="json"), self.clock())

    # -- reading --------------------------------------------------------------
    async def handle_list(self, data: ConversationList, _context: EventContext) -> dict[str, Any]:
        items, total = await self.reader.listing(
            self.clock(), agent_id=data.agent_id, model=data.model, status=data.status,
            tag=data.tag, text=data.text, since=data.since, limit=data.limit, offset=data.offset,
        )
        return {"conversations": items, "total": total, "limit": data.limit, "offset": data.offset}

    async def _transcript(self, conversation_id: str, inherited: bool = True) -> dict[str, Any]:
        return await self.reader.transcript(conversation_id, inherited, self.clock())

    async def handle_show(self, data: ConversationShow, _context: EventContext) -> dict[str, Any]:
        transcript = await self._transcript(data.conversation_id, data.inherited)
        exchanges = transcript["exchanges"]
        end = None if data.limit is None else data.offset + data.limit
        return {**transcript, "exchanges": exchanges[data.offset:end], "total_exchanges": len(exchanges),
                "offset": data.offset}

    async def handle_sent(self, data: ConversationSent, _context: EventContext) -> dict[str, Any]:
        return await rebuild_sent(self.reader, data.conversation_id, data.n, self.clock())

    async def handle_stats(self, data: ConversationStats, _context: EventContext) -> dict[str, Any]:
        transcript = await self._transcript(data.conversation_id)
        stats = stats_of(transcript)
        return {**stats, "calibration": self.calibration(sorted(stats["models"])),
                "conversation": transcript["conversation"]}

    async def handle_export(self, data: ConversationExport, _context: EventContext) -> dict[str, Any]:
        transcript = await self._transcript(data.conversation_id, data.inherited)
        return {"conversation_id": data.conversation_id, "format": data.format,
                "exchanges": len(transcript["exchanges"]), "content": render(transcript, data.format)}

    # -- metadata -------------------------------------------------------------
    async def _change(self, conversation_id: str, changes: dict[str, Any],
                      extra: dict[str, Any] | None = None) -> ConversationMeta:
        """Apply `changes` (and `extra`, merged into the metadata's extras) to the metadata as it is
        under the lock: a commit that changed it meanwhile (pending input taken) is never undone."""
        memory = await self.cache.require(conversation_id)
        async with memory.lock:
            if extra:
                changes = {**changes, "extra": {**memory.meta.extra, **extra}}
            meta = memory.meta.model_copy(update=changes, deep=True)
            meta = ConversationMeta.model_validate(meta.model_dump())
            await self.writer.save_meta(memory, meta)
        return meta

    async def handle_update(self, data: ConversationUpdate, context: EventContext) -> dict[str, Any]:
        changes: dict[str, Any] = {}
        if "pins" in data.model_fields_set:  # checked first: refused pins leave everything as it was
            pins = sorted(set(data.pins or []))
            memory = await self.cache.require(data.conversation_id)
            entries, allowed = await self._pin_facts(memory, pins)
            self._pins_within(pins, entries, allowed)
            changes["pins"] = pins
        extra: dict[str, Any] = {}
        for name in data.model_fields_set - {"conversation_id", "pins"}:
            value = getattr(data, name)
            if name == "tags":
                value = list(dict.fromkeys(value or []))
            if name == "status" and value is None:
                continue
            if name == "metadata":  # kept with the other client extras, not as a field of its own
                extra["metadata"] = dict(value or {})
                continue
            changes[name] = value  # an explicit null clears title, ttl or turn_cap
        meta = await self._change(data.conversation_id, changes, extra)
        updated = sorted([*changes, *(["extra"] if extra else [])])
        log.info("conversation_updated", conversation_id=data.conversation_id, fields=updated)
        self._changed(data.conversation_id, "updated", context)
        return {"conversation": self._summary(meta), "updated": updated}

    async def handle_archive(self, data: ConversationArchive, context: EventContext) -> dict[str, Any]:
        meta = await self._change(data.conversation_id, {"status": "archived"})
        self._changed(data.conversation_id, "archived", context)
        return {"conversation": self._summary(meta)}

    # -- pins -----------------------------------------------------------------
    async def _pin_facts(self, memory: ConversationMemory, numbers: list[int]
                         ) -> tuple[dict[int, IndexEntry], int]:
        """The history exchanges of the conversation's chain by number (refusing any of `numbers` it
        lacks), and the tokens its pins may take of a turn."""
        chain = await fork_chain(self.cache, memory, self.settings.max_fork_depth)
        entries = {}
        for member, upto in chain:
            await self.cache.load_all(member)
            entries.update({e.n: e for e in member.entries if upto is None or e.n <= upto})
        unknown = [n for n in numbers if n not in entries or entries[n].is_feedback]
        if unknown:
            raise KsiError(ErrorCode.VALIDATION_ERROR,
                           f"conversation {memory.conversation_id} has no exchange {unknown[0]} to pin "
                           "(feedback is never in history)",
                           fields={"n": f"no history exchange {unknown[0]}"}, exchanges=memory.next_n - 1)
        # before any lock: the budget may wait for litellm's import (the model's window), and a
        # turn committing meanwhile must not wait for that
        return entries, await self.pins_budget(memory.meta)

    @staticmethod
    def _pins_within(pins: list[int], entries: dict[int, IndexEntry], allowed: int) -> int:
        tokens = sum(entries[n].tokens_in + entries[n].tokens_out for n in pins if n in entries)
        if tokens > allowed:
            raise KsiError(ErrorCode.PINS_OVER_BUDGET,
                           f"the pinned exchanges would take about {tokens} tokens of every turn; their share "
                           f"of this conversation's history budget is {allowed}",
                           pins=pins, tokens=tokens, allowed=allowed)
        return tokens

    async def handle_pin(self, data: ConversationPin, context: EventContext) -> dict[str, Any]:
        memory = await self.cache.require(data.conversation_id)
        entries, allowed = await self._pin_facts(memory, data.n)
        async with memory.lock:
            pins = sorted(set(memory.meta.pins) | set(data.n))
            tokens = self._pins_within(pins, entries, allowed)
            meta = memory.meta.model_copy(update={"pins": pins}, deep=True)
            await self.writer.save_meta(memory, meta)
        log.info("conversation_pinned", conversation_id=data.conversation_id, pins=pins)
        self._changed(data.conversation_id, "pinned", context)
        return {"conversation_id": data.conversation_id, "pins": pins, "tokens": tokens, "allowed": allowed}

    async def handle_unpin(self, data: ConversationPin, context: EventContext) -> dict[str, Any]:
        memory = await self.cache.require(data.conversation_id)
        async with memory.lock:
            pins = [n for n in memory.meta.pins if n not in data.n]
            meta = memory.meta.model_copy(update={"pins": pins}, deep=True)
            await self.writer.save_meta(memory, meta)
        self._changed(data.conversation_id, "unpinned", context)
        return {"conversation_id": data.conversation_id, "pins": pins}

    # -- fork -----------------------------------------------------------------
    async def handle_fork(self, data: ConversationFork, context: EventContext) -> dict[str, Any]:
        parent = await self.cache.require(data.conversation_id)
        chain = await fork_chain(self.cache, parent, self.settings.max_fork_depth)  # fork_cycle surfaces here
        count = parent.total
        at = count if data.at is None else data.at
        if not 0 <= at <= count:
            raise KsiError(ErrorCode.VALIDATION_ERROR,
                           f"at must be between 0 and {count}, the exchanges of {data.conversation_id}",
                           fields={"at": f"must be between 0 and {count}"}, exchanges=count)
        fork_id = data.new_id or new_id("conv-")
        await self._check_free(fork_id, "new_id")
        now = format_ts(self.clock())
        model = await self._model_at(chain, at)
        fork_point = await fork_point_digest(self.cache, parent, at, self.settings.max_fork_depth, data.digest)
        meta = ConversationMeta(
            conversation_id=fork_id, created=now, last_activity=now, parent_id=parent.conversation_id,
            fork_at=at, title=data.title if data.title is not None else parent.meta.title,
            tags=list(parent.meta.tags), agent_id=parent.meta.agent_id, system=system_at(parent.meta, at),
            ttl=parent.meta.ttl, turn_cap=parent.meta.turn_cap,
            models=[model] if model else [],  # so the fork continues with the model it branched from
            origin=data.origin, preview=parent.meta.preview if at else None,  # exchange 1 is shared
            pins=[n for n in parent.meta.pins if n <= at],  # the shared prefix keeps its pins
            scope=parent.meta.scope, fork_digest=fork_point,  # matched for the parent's users
        )
        try:
            await self.writer.create(meta)
        except ConversationExists:
            raise self._taken(fork_id, "new_id") from None
        log.info("conversation_forked", conversation_id=fork_id, parent_id=parent.conversation_id, at=at)
        self._changed(fork_id, "created", context)
        return {"conversation_id": fork_id, "parent_id": parent.conversation_id, "fork_at": at,
                "conversation": self._summary(meta)}

    async def _model_at(self, chain: list[tuple[ConversationMemory, int | None]], at: int) -> str | None:
        for member, _upto in chain:
            if member.meta.imported_at is not None:
                return None  # a model an import named is history, not a route
            if member.entry(at) is None:  # a fork at a loaded exchange reads no index
                await self.cache.load_all(member)
            for entry in member.entries:
                if entry.n == at:
                    return entry.model
        return None

    async def _check_free(self, conversation_id: str, field_name: str) -> None:
        if await self.writer.taken(conversation_id):
            raise self._taken(conversation_id, field_name)

    @staticmethod
    def _taken(conversation_id: str, field_name: str) -> KsiError:
        return KsiError(ErrorCode.CONVERSATION_EXISTS, f"conversation {conversation_id} already exists",
                        conversation_id=conversation_id, fields={field_name: "a conversation with this id exists"})

    # -- import ---------------------------------------------------------------
    async def handle_import(self, data: ConversationImport, context: EventContext) -> dict[str, Any]:
        document = parse_export(data.data, data.format)
        conversation_id = data.new_id or new_id("conv-")
        now = format_ts(self.clock())

        def prepared() -> tuple[ConversationMeta, list[tuple[IndexEntry, list[dict[str, Any]]]], int,
                                list[tuple[str, str]]]:
            checked = checked_document(document)  # whole, before anything is written
            return self._imported(checked, conversation_id, now, data.title)

        exchanges_sent = document.get("exchanges")
        if isinstance(exchanges_sent, list) and len(exchanges_sent) > IMPORTED_ON_THE_LOOP:
            # checking and building 5,000 exchanges takes the loop for a quarter of a second
            meta, exchanges, skipped, stored_images = await asyncio.to_thread(prepared)
        else:
            meta, exchanges, skipped, stored_images = prepared()
        await self._check_stored(stored_images)
        await self._check_free(conversation_id, "new_id")
        meta.origin = data.origin
        meta.continues = data.continues
        meta.scope = dict(data.scope) if data.scope else None
        if data.for_run:
            meta.extra[MADE_FOR_RUN] = True
        if data.metadata:
            meta.extra["metadata"] = dict(data.metadata)
        if data.pending:  # items without a reply: one write with the exchanges, all or nothing
            meta.pending_input, _added = pended(meta, data.pending, now, "pending")
            meta.preview = meta.preview or preview_of(data.pending[0])
        try:
            await self.writer.import_conversation(meta, exchanges)
        except ConversationExists:
            raise self._taken(conversation_id, "new_id") from None
        log.info("conversation_imported", conversation_id=conversation_id, exchanges=meta.exchanges)
        self._changed(conversation_id, "created", context)
        return {"conversation_id": conversation_id, "exchanges": meta.exchanges, "skipped": skipped,
                "imported_from": document["conversation"].get("conversation_id"),
                "conversation": self._summary(meta)}

    async def _check_stored(self, stored_images: list[tuple[str, str]]) -> None:
        """Every image (or PDF) the kept exchanges name by hash is in this daemon's blob store: an export
        from another machine names bytes that never came with it, and a later turn could not send them."""
        for where, sha256 in stored_images:
            if not await self.blobs.has(sha256):
                what = "file" if ".file." in where else "image"
                raise KsiError(ErrorCode.IMAGE_NOT_STORED,
                               f"the export cannot be imported: {where}: the {what} sha256:{sha256} is not stored "
                               "here (an export carries references, not the bytes)",
                               fields={where: f"no stored {what} has this hash"}, sha256=sha256)

    def _imported(self, document: ImportedDocument, conversation_id: str, now: str, title: str | None
                  ) -> tuple[ConversationMeta, list[tuple[IndexEntry, list[dict[str, Any]]]], int,
                             list[tuple[str, str]]]:
        """The new conversation's metadata and exchanges (index entry and response lines each), the
        number of exchanges skipped, and the stored images the kept ones name (field, sha256).

        The models the document names are history: they stay on its exchanges but are not the
        conversation's models, so a continuation never routes to a provider an import chose."""
        source = document.conversation
        exchanges: list[tuple[IndexEntry, list[dict[str, Any]]]] = []
        named: list[str] = []
        tokens_in = tokens_out = 0
        cost = 0.0
        skipped = 0
        stored_images: list[tuple[str, str]] = []
        renumbered: dict[int, int] = {}  # the document's exchange numbers -> the new ones (for pins)
        for position, (exchange, found) in enumerate(zip(document.exchanges, checked_items(document), strict=True),
                                                     start=1):
            if not found.output:
                skipped += 1  # an exchange whose reply was lost cannot be continued from
                continue
            stored_images.extend(found.stored_images)
            reply = exchange.reply or ImportedReply(content="")
            renumbered[position] = len(exchanges) + 1
            model = exchange.model or reply.model or "imported"
            exchanges.append(_imported_exchange(exchange, reply, found, model, len(exchanges) + 1,
                                                conversation_id, now))
            tokens_in += int(reply.usage.get("prompt_tokens") or 0)
            tokens_out += int(reply.usage.get("completion_tokens") or 0)
            cost += reply.cost or 0.0
            if exchange.model or reply.model:
                if model in named:
                    named.remove(model)
                named.append(model)
        for (entry, _lines), digest in zip(exchanges, record_chain(source.system, [lines for _e, lines in exchanges]),
                                           strict=True):
            entry.digest = digest
        meta = ConversationMeta(
            conversation_id=conversation_id, created=now, last_activity=now,
            title=title if title is not None else source.title,
            tags=list(source.tags), agent_id=source.agent_id, system=source.system,
            ttl=self.settings.default_ttl, exchanges=len(exchanges), tokens_in=tokens_in, tokens_out=tokens_out,
            cost=cost, models=[], pins=sorted({renumbered[n] for n in source.pins if n in renumbered}),
            imported_from=source.conversation_id, imported_at=now, imported_models=named,
            preview=next((preview_of(line["content"]) for _entry, lines in exchanges[:1] for line in lines
                          if line["type"] in ("user", "feedback")), None),
        )
        return meta, exchanges, skipped, stored_images

    # -- append ---------------------------------------------------------------
    async def handle_append(self, data: ConversationAppend, context: EventContext) -> dict[str, Any]:
        """Exchanges a client already has (the Conversations API's items) become this conversation's
        newest ones, written in the daemon's durability order under the lock a completion commits under."""
        memory = await self.cache.require(data.conversation_id)
        if memory.meta.status == "archived":
            raise KsiError(ErrorCode.CONVERSATION_ARCHIVED, f"conversation {data.conversation_id} is archived",
                           conversation_id=data.conversation_id)
        if data.items is not None:
            taken = await self._take_over_run(memory, data.items, context)
            if taken is not None:
                return taken
            written = await self._from_items(memory, data)
            if written is None:  # every item is held already
                return {"conversation_id": memory.conversation_id, "response_ids": [], "exchanges": []}
            data = written
        return await self._append(memory, data, context)

    async def _append(self, memory: ConversationMemory, data: ConversationAppend,
                      context: EventContext) -> dict[str, Any]:
        count = self.cache.count_tokens
        async with memory.lock:
            now = format_ts(self.clock())
            appended: list[NewExchange] = []
            held = pending_of(memory.meta)
            exchanges = list(data.exchanges)
            already_held: IndexEntry | None = None  # the newest exchange, when it is the reply given
            if data.reply_to_pending is not None and not held:
                already_held = await self._newest_replying(memory, data.reply_to_pending)
                if already_held is None:
                    raise KsiError(ErrorCode.VALIDATION_ERROR,
                                   f"conversation {data.conversation_id} holds no user input waiting for a reply, "
                                   "and its newest exchange's reply is not this one",
                                   fields={"reply_to_pending": "no pending input to reply to"})
            elif data.reply_to_pending is not None:
                exchanges.insert(0, AppendedExchange(input=pending_items(memory.meta), output=[
                    {"type": "message", "role": "assistant", "content": data.reply_to_pending}]))
            for exchange in exchanges:
                inputs, output = exchange.input_items(), exchange.output_items()
                lines = [item_line(item, "user", None, now, memory.conversation_id) for item in inputs]
                lines.append(answer_line(output, {
                    "model": None, "usage": {}, "ts": now, "conversation_id": memory.conversation_id,
                    "appended": True}))
                # numbered and chained by the writer, after the head it finds
                entry = IndexEntry(n=0, response_id=new_response_id("appended"), ts=now,
                                   tokens_in=sum(count(item_text(item)) + 4 for item in inputs),
                                   tokens_out=sum(count(item_text(item)) + 4 for item in output))
                appended.append(NewExchange(entry, lines, Exchange(input=inputs, output=output)))
            first = memory.total == 0
            if data.pending:  # checked whole before anything is written
                pended(memory.meta, data.pending, now, "pending")

            def meta_after(meta: ConversationMeta, entries: list[IndexEntry]) -> ConversationMeta:
                changes: dict[str, Any] = {"exchanges": meta.exchanges + len(entries), "last_activity": now}
                if first and meta.preview is None:
                    first_pending = data.pending[0] if data.pending else ""
                    changes["preview"] = preview_of(item_text(exchanges[0].input_items()[0]) if exchanges else (
                        first_pending if isinstance(first_pending, str) else item_text(first_pending)))
                # the pending input answered (`held`) leaves with the first exchange, in the writer
                if data.pending:  # what follows the exchanges waits for a reply: held in the same write
                    changes["pending_input"], _added = pended(meta, data.pending, now, "pending")
                return meta.model_copy(update=changes)

            if appended:
                answers = [entry.id for entry in held] if data.reply_to_pending is not None else []
                await self.writer.commit(memory, appended, memory.meta.system, meta_after, answers=answers)
            elif already_held is None or data.pending:
                await self.writer.save_meta(memory, meta_after(memory.meta, []))
        if appended or already_held is None or data.pending:
            self._changed(memory.conversation_id, "updated", context)
        held_entries = [already_held] if already_held is not None else []
        return {"conversation_id": memory.conversation_id,
                "response_ids": [e.response_id for e in held_entries] + [x.entry.response_id for x in appended],
                "exchanges": [e.n for e in held_entries] + [x.entry.n for x in appended]}

    async def _take_over_run(self, memory: ConversationMemory, raw: list[dict[str, Any]],
                             context: EventContext) -> dict[str, Any] | None:
        """When a run's responses just stored this conversation's items then the items added in a
        conversation of their own, this one takes those exchanges (see adoption.py); None when not."""
        if not raw or not may_take_over(memory):
            return None
        try:  # read whole: items the conversation holds already may open them, which the normal path takes
            added = added_items(raw, 0, holds_pending=False)
        except KsiError:
            return None
        if added.pending or added.reply_to_pending is not None or not added.exchanges:
            return None
        wanted = [normalised(item, f"items.{position}") for position, item in enumerate(raw)]
        if not memory.complete:
            await self.cache.load_all(memory)
        held = exchange_items(await self.cache.texts(memory, memory.entries))
        count = memory.total + len(added.exchanges)
        for source in candidates(memory, self.cache.held(), self.clock(), count):
            if not source.complete:
                await self.cache.load_all(source)
            entries = [entry for entry in source.entries if entry.n > source.base]
            if not repeats(await self.cache.texts(source, entries), held, wanted):
                continue
            async with memory.lock, source.lock:
                if source.retired or source.total != count or memory.total != count - len(added.exchanges):
                    return None  # moved meanwhile: the items are added as any others
                if not await self.writer.adopt(memory, source, adopted_meta(memory.meta, source.meta)):
                    return None
            self._changed(source.conversation_id, "deleted", context)
            self._changed(memory.conversation_id, "updated", context)
            taken = entries[count - len(added.exchanges):]  # the run's own: what the items added
            return {"conversation_id": memory.conversation_id, "response_ids": [e.response_id for e in taken],
                    "exchanges": [e.n for e in taken], "adopted_from": source.conversation_id}
        return None

    async def _from_items(self, memory: ConversationMemory, data: ConversationAppend) -> ConversationAppend | None:
        """The append `data.items` make after what the conversation holds (None: nothing new)."""
        raw = list(data.items or [])
        await self.cache.load_newest(memory)
        entries = memory.entries[-min(len(raw), len(memory.entries)):] if memory.entries else []
        tail = [item for held in await self.cache.texts(memory, entries) for item in (*held.input, *held.output)]
        tail += pending_items(memory.meta)
        start = not_held(tail, [normalised(item, f"items.{position}") for position, item in enumerate(raw)])
        if start == len(raw):
            return None
        added = added_items(raw, start, bool(pending_of(memory.meta)))
        outputs = [item for item in added.pending if isinstance(item, dict)]
        if outputs:  # a call's output waits only for a call the conversation's newest items made
            if added.exchanges:
                calls = added.exchanges[-1].output_items()
            else:
                calls = (await self.cache.texts(memory, entries[-1:]))[0].output if entries else []
            check_open_calls(outputs, calls, len(raw) - len(added.pending))
        return ConversationAppend(conversation_id=memory.conversation_id, exchanges=added.exchanges,
                                  reply_to_pending=added.reply_to_pending, pending=added.pending)

    async def _newest_replying(self, memory: ConversationMemory, reply: str) -> IndexEntry | None:
        """The newest exchange when its reply is `reply` (as digests compare text): a client that
        adds the answer it got from a response this conversation already holds (the response was
        matched to the conversation by its pending input) repeats what is stored."""
        if memory.total <= memory.base:
            return None
        entry = memory.entry(memory.total)
        if entry is None:
            await self.cache.load_newest(memory)
            entry = memory.entry(memory.total)
        if entry is None:
            return None
        [exchange] = await self.cache.texts(memory, [entry])
        return entry if canonical_text(exchange.reply) == canonical_text(reply) else None

    async def handle_pend(self, data: ConversationPend, context: EventContext) -> dict[str, Any]:
        """User messages a client added without a reply (the Conversations API's items): kept in the
        metadata under the lock an exchange commits under, which takes and clears them."""
        memory = await self.cache.require(data.conversation_id)
        if memory.meta.status == "archived":
            raise KsiError(ErrorCode.CONVERSATION_ARCHIVED, f"conversation {data.conversation_id} is archived",
                           conversation_id=data.conversation_id)
        async with memory.lock:
            pending = pending_of(memory.meta)
            now = format_ts(self.clock())
            waiting, added = pended(memory.meta, data.inputs, now, "inputs")
            changes: dict[str, Any] = {"pending_input": waiting, "last_activity": now}
            if memory.total == 0 and memory.meta.preview is None:
                changes["preview"] = preview_of(data.inputs[0])
            meta = memory.meta.model_copy(update=changes)
            await self.writer.save_meta(memory, meta)
        self._changed(memory.conversation_id, "updated", context)
        return {"conversation_id": memory.conversation_id, "added": [entry.wire() for entry in added],
                "pending": [entry.wire() for entry in (*pending, *added)]}

    async def handle_abandon_calls(self, data: ConversationAbandonCalls, context: EventContext) -> dict[str, Any]:
        """Open calls given up: an output marked abandoned is held for each, as a call's output a
        client added waits, for the next turn to take as its first input."""
        memory = await self.cache.require(data.conversation_id)
        if memory.meta.status == "archived":
            raise KsiError(ErrorCode.CONVERSATION_ARCHIVED, f"conversation {data.conversation_id} is archived",
                           conversation_id=data.conversation_id)
        await self.cache.load_newest(memory)  # before the lock: a conversation in use is not loaded further
        async with memory.lock:
            if memory.users:  # its newest exchange may be about to change: what is open is not known yet
                raise KsiError(ErrorCode.TURN_IN_PROGRESS,
                               f"a request is queued or running on conversation {data.conversation_id}; "
                               "abandon its calls once it has ended", conversation_id=data.conversation_id)
            answered = set(call_ids_answered(pending_items(memory.meta)))
            made = await open_calls(self.cache, memory, self.settings.max_fork_depth)
            open_ids = [str(call["call_id"]) for call in made if str(call["call_id"]) not in answered]
            chosen = open_ids if data.call_ids is None else list(dict.fromkeys(data.call_ids))
            not_open = [call_id for call_id in chosen if call_id not in open_ids]
            if not_open or not chosen:
                raise KsiError(ErrorCode.CALL_NOT_OPEN,
                               f"conversation {data.conversation_id} waits for no call "
                               f"{', '.join(not_open) if not_open else 'at all'} "
                               f"(open: {', '.join(open_ids) if open_ids else 'none'})",
                               fields={"call_ids": "not open: " + ", ".join(not_open or ["none open"])},
                               call_ids=not_open, open_call_ids=open_ids)
            outputs = [{"type": "function_call_output", "call_id": call_id, "output": ABANDONED_OUTPUT,
                        "abandoned": True} for call_id in chosen]
            now = format_ts(self.clock())
            waiting, added = pended(memory.meta, list(outputs), now, "call_ids")
            await self.writer.save_meta(memory, memory.meta.model_copy(update={"pending_input": waiting,
                                                                              "last_activity": now}))
        self._changed(memory.conversation_id, "updated", context)
        return {"conversation_id": memory.conversation_id, "abandoned": chosen,
                "pending": [entry.wire() for entry in added]}

    # -- responses ------------------------------------------------------------
    async def handle_response_show(self, data: ResponseRef, _context: EventContext) -> dict[str, Any]:
        found = await locate(self.cache, self.responses, data.response_id)
        record = found.record
        written_in = next((line.get("conversation_id") for line in (record.outcome, *record.inputs)
                           if line and line.get("conversation_id")), None)
        return {
            "response_id": record.response_id,
            "status": "completed" if record.ok else ("failed" if record.outcome else "incomplete"),
            "conversation_id": found.conversation_id or written_in,
            "exchange": found.n,  # its number in that conversation; null when it is in no history
            "exchanges": found.memory.total if found.memory is not None else None,
            "newest": found.newest,
            "previous_response_id": await previous_of(self.cache, found),
            "inputs": record.inputs,
            "outcome": record.outcome,
        }

    async def handle_response_delete(self, data: ResponseRef, _context: EventContext) -> dict[str, Any]:
        # Every exchange after this one was answered with it in view: removing it alone would make
        # the log lie. Its conversation (and with it the response) can be deleted.
        found = await locate(self.cache, self.responses, data.response_id)
        if found.conversation_id is not None:
            raise KsiError(ErrorCode.RESPONSE_NOT_DELETABLE,
                           f"response {data.response_id} is exchange {found.n} of conversation "
                           f"{found.conversation_id}; delete the conversation to remove it",
                           response_id=data.response_id, conversation_id=found.conversation_id)
        raise KsiError(ErrorCode.RESPONSE_NOT_DELETABLE,
                       f"response {data.response_id} is kept in the log (it is in no conversation's history)",
                       response_id=data.response_id)

    # -- delete ---------------------------------------------------------------
    async def handle_delete(self, data: ConversationDelete, context: EventContext) -> dict[str, Any]:
        conversation_id = data.conversation_id
        memory = await self.cache.require(conversation_id)
        previous = memory.meta
        # Refuse new requests while it goes (in memory only), then end the ones already queued.
        memory.meta = previous.model_copy(update={"status": "archived"})
        try:
            cancelled = await self.cancel_requests(conversation_id)
            async with memory.lock:
                removed = await self.writer.delete(memory)
        except BaseException:
            memory.meta = previous
            raise
        self.cache.forget(conversation_id)
        forks = await self.writer.forks_of(conversation_id)
        log.info("conversation_deleted", conversation_id=conversation_id, files=len(removed))
        self._changed(conversation_id, "deleted", context)
        return {"conversation_id": conversation_id, "deleted": True, "removed": removed,
                "cancelled_requests": cancelled, "orphaned_forks": forks}


def _image_refs(inputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The references of the images among input items (counted by the image rule, not as text)."""
    return [part.get("image") or {} for item in inputs if isinstance(item.get("content"), list)
            for part in item["content"] if part.get("type") == "input_image"]


def _imported_exchange(exchange: ImportedExchange, reply: ImportedReply, found: ExchangeItems, model: str, n: int,
                       conversation_id: str, now: str) -> tuple[IndexEntry, list[dict[str, Any]]]:
    """One kept exchange of an imported document: its index entry and its response lines."""
    ts = exchange.ts or reply.ts or now
    lines = imported_lines(found, exchange.is_feedback, conversation_id, ts)
    outcome = answer_line(found.output, {
        "model": model, "provider": exchange.provider or reply.provider, "usage": reply.usage,
        "cost": reply.cost, "finish_reason": reply.finish_reason,
        "duration_ms": reply.duration_ms, "ts": reply.ts or ts,
        "conversation_id": conversation_id, "imported_from": exchange.response_id,
    })
    # counted as a summariser or a budget sees the items: text, calls, outputs, references
    text_in = sum(len(item_text(item)) for item in found.input
                  if not (item["type"] == "message" and item["role"] == "system"))
    text_out = sum(len(item_text(item)) for item in found.output)
    images_in = sum(image_tokens(model, ref.get("width"), ref.get("height"), ref.get("detail"))
                    for ref in _image_refs(found.input))
    history_in, history_out = exchange.history_counts()
    entry = IndexEntry(
        n=n, response_id=new_response_id(model), ts=ts, model=model, provider=outcome["provider"],
        agent_id=exchange.agent_id,
        tokens_in=history_in if history_in is not None else text_in // 4 + 4 + images_in,
        tokens_out=history_out if history_out is not None else text_out // 4 + 4,
        is_feedback=exchange.is_feedback,
    )
    return entry, [*lines, outcome]
