"""Copy everything one storage backend holds into another, through the storage ports only.

Idempotent and resumable: what the destination already holds is kept and only what it lacks is
copied (a conversation's exchanges after its head there, a trace's lines after the ones it has),
so a migration interrupted anywhere is finished by running it again. The counts of both sides
are compared at the end. The request journal is not copied: it belongs to one daemon's run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ksi_common.errors import ErrorCode, KsiError
from ksi_daemon.storage.ports import ExchangeConflict, Storage

Progress = Callable[[str, int], None]  # (kind, copied so far)


@dataclass
class Tally:
    """What each side holds, kind by kind, and what this run copied."""

    source: dict[str, int] = field(default_factory=dict)
    destination: dict[str, int] = field(default_factory=dict)
    copied: dict[str, int] = field(default_factory=dict)

    @property
    def verified(self) -> bool:
        return all(self.destination.get(kind, 0) >= count for kind, count in self.source.items())

    def mismatches(self) -> dict[str, tuple[int, int]]:
        return {kind: (count, self.destination.get(kind, 0)) for kind, count in self.source.items()
                if self.destination.get(kind, 0) < count}

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "destination": self.destination, "copied": self.copied,
                "verified": self.verified, "mismatches": {k: list(v) for k, v in self.mismatches().items()}}


def _noop(_kind: str, _count: int) -> None:
    return None


async def migrate(source: Storage, destination: Storage, progress: Progress = _noop) -> Tally:
    """Copy `source` into `destination` (both opened); returns the verified counts."""
    tally = Tally()

    def copied(kind: str, count: int = 1) -> None:
        tally.copied[kind] = tally.copied.get(kind, 0) + count
        progress(kind, tally.copied[kind])

    await _blobs(source, destination, copied)  # first: a record copied is never without its image
    await _conversations(source, destination, copied)
    await _loose_responses(source, destination, copied)
    for record in await source.agents.load_all():
        if await destination.agents.load(record.agent_id) is None:
            await destination.agents.create(record)
            copied("agents")
    for name, record in (await source.consortia.load_all()).items():
        if await destination.consortia.load(name) is None:
            definition = {k: v for k, v in record.items() if k not in ("v", "name", "created", "updated")}
            await destination.consortia.save(name, definition)
            copied("consortia")
    ratios = await source.calibration.load()
    if ratios and not await destination.calibration.load():
        await destination.calibration.save(ratios)
        copied("calibration")
    for run_id in await source.traces.run_ids():
        lines = await source.traces.read(run_id) or []
        have = len(await destination.traces.read(run_id) or [])
        for line in lines[have:]:
            await destination.traces.append(run_id, line, durable=False)
        if lines[have:]:
            copied("trace_lines", len(lines) - have)
    tally.source = await count(source)
    tally.destination = await count(destination)
    return tally


async def _blobs(source: Storage, destination: Storage, copied: Callable[..., None]) -> None:
    """Every blob the destination lacks; a damaged one (its bytes no longer have their hash) is not
    copied and the rest go on: the final counts show it as a mismatch, and `damaged_blobs` counts it."""
    for sha256 in await source.blobs.ids():
        if await destination.blobs.has(sha256):
            continue
        try:
            data = await source.blobs.get(sha256)
        except KsiError as exc:
            if exc.code != ErrorCode.STORAGE_ERROR:
                raise
            copied("damaged_blobs")
            continue
        if data is not None:  # the media type is the referring records', not the store's
            await destination.blobs.put(data, "application/octet-stream")
            copied("blobs")


async def _conversations(source: Storage, destination: Storage, copied: Callable[..., None]) -> None:
    src, dst = source.conversations, destination.conversations
    for conversation_id in await src.conversation_ids():
        meta = await src.load_meta(conversation_id)
        if meta is None:
            continue
        if not await dst.exists(conversation_id):
            # created with the source's metadata; saved again after the exchanges (a resumed copy
            # may have stopped between them)
            await dst.create(meta)
            copied("conversations")
        head = await dst.head(conversation_id)
        missing = [e for e in await src.entries(conversation_id) if e.n > head]
        records = await source.responses.read_many([e.response_id for e in missing])
        appended = 0
        for entry, record in zip(missing, records, strict=True):
            lines = [*record.inputs, *([record.outcome] if record.outcome else [])] if record else None
            try:
                await dst.append_exchange(conversation_id, entry, response=lines)
            except ExchangeConflict:  # a legacy index numbering one exchange twice: the first one stands
                copied("exchanges_skipped")
                continue
            appended += 1
        if appended:
            copied("exchanges", appended)
        summaries = await source.summaries.read(conversation_id)
        have = len(await destination.summaries.read(conversation_id))
        for summary in summaries[have:]:
            await destination.summaries.append(summary)
        if summaries[have:]:
            copied("summaries", len(summaries) - have)
        await dst.save_meta(meta)


async def _loose_responses(source: Storage, destination: Storage, copied: Callable[..., None]) -> None:
    """Response records no index lists (failed requests, consortium calls), and any indexed one
    the exchanges above did not bring (an index line whose record came later)."""
    ids = await source.responses.ids()
    batch = 500
    for start in range(0, len(ids), batch):
        chunk = ids[start:start + batch]
        have = await destination.responses.read_many(chunk)
        wanted = [r for r, present in zip(chunk, have, strict=True) if present is None]
        for response_id, record in zip(wanted, await source.responses.read_many(wanted), strict=True):
            if record is None:
                continue
            await destination.responses.write(response_id, [*record.inputs, *([record.outcome] if record.outcome else [])])
            copied("responses")


async def count(storage: Storage) -> dict[str, int]:
    """What a backend holds, kind by kind (what a migration must carry over)."""
    conversations = await storage.conversations.conversation_ids()
    exchanges = summaries = 0
    for conversation_id in conversations:
        exchanges += len(await storage.conversations.entries(conversation_id))
        summaries += len(await storage.summaries.read(conversation_id))
    traces = await storage.traces.run_ids()
    trace_lines = 0
    for run_id in traces:
        trace_lines += len(await storage.traces.read(run_id) or [])
    return {
        "conversations": len(conversations),
        "exchanges": exchanges,
        "responses": len(await storage.responses.ids()),
        "agents": len(await storage.agents.load_all()),
        "consortia": len(await storage.consortia.load_all()),
        "trace_lines": trace_lines,
        "summaries": summaries,
        "calibrated_models": len(await storage.calibration.load()),
        "blobs": len(await storage.blobs.ids()),
    }
