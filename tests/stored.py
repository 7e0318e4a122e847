"""What a daemon stored, read back whatever the backend: the tests' view of storage.

Records come through the read port (`ksi_common.reading.open_reader`, as the inspection commands
read them, with the daemon running or stopped). A snapshot names every stored item as the var-dir
layout names it (`logs/responses/ID.jsonl`, `state/conversations/ID.json`, ...), so "this and only
this changed" reads the same for files and for rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import asyncpg
import orjson

from ksi_common.reading import StoredReader, open_reader
from ksi_common.settings import Settings
from ksi_daemon.daemon import Daemon


def stored_reader(settings: Settings) -> StoredReader:
    url = settings.database_url.get_secret_value() if settings.database_url is not None else None
    return open_reader(settings.storage, settings.layout, url)


async def stored_index(daemon: Daemon, conversation_id: str) -> list[dict[str, Any]]:
    """A conversation's own index: one record per exchange, as an index line holds it."""
    reader = stored_reader(daemon.settings)
    try:
        return [entry.to_record() for entry in await reader.entries(conversation_id)]
    finally:
        await reader.aclose()


async def stored_response(daemon: Daemon, response_id: str) -> list[dict[str, Any]] | None:
    """A response record's lines (inputs, then the outcome); None when there is none."""
    reader = stored_reader(daemon.settings)
    try:
        (record,) = await reader.responses([response_id])
    finally:
        await reader.aclose()
    if record is None:
        return None
    return [*record.inputs, *([record.outcome] if record.outcome is not None else [])]


async def stored_meta(daemon: Daemon, conversation_id: str) -> dict[str, Any] | None:
    reader = stored_reader(daemon.settings)
    try:
        (meta,) = await reader.metas([conversation_id])
    finally:
        await reader.aclose()
    return meta


SKIPPED = ("run/", "logs/daemon/", "state/requests.jsonl", "state/calibration.json",  # what any request changes
           "state/exchange-log/",  # records wait there until the files they cover are synced
           "state/digests.jsonl")  # derived from the indexes (a delete or a move notes itself there)


async def stored_snapshot(settings: Settings) -> dict[str, Any]:
    """Every stored item except what any request changes (the journal, calibration, the socket dir,
    the daemon's log), by layout name."""
    if settings.storage == "jsonl":
        var: Path = settings.layout.root
        return {str(p.relative_to(var)): p.read_bytes() for p in sorted(var.rglob("*"))
                if p.is_file() and not str(p.relative_to(var)).startswith(SKIPPED)}
    assert settings.database_url is not None
    conn = await asyncpg.connect(settings.database_url.get_secret_value())
    try:
        items: dict[str, Any] = {}
        for row in await conn.fetch("SELECT conversation_id, meta::text FROM ksi_conversations"):
            if row["meta"] is not None:
                items[f"state/conversations/{row['conversation_id']}.json"] = row["meta"]
        # an index line does not name its own conversation (a moved index keeps its lines)
        for row in await conn.fetch("SELECT conversation_id, json_agg(to_jsonb(e) - 'conversation_id' - 'tokens_before' "
                                    "ORDER BY n)::text AS lines FROM ksi_exchanges e GROUP BY conversation_id"):
            items[f"logs/conversations/{row['conversation_id']}.jsonl"] = row["lines"]
        for row in await conn.fetch("SELECT conversation_id, json_agg(record ORDER BY seq)::text AS lines "
                                    "FROM ksi_summaries GROUP BY conversation_id"):
            items[f"logs/summaries/{row['conversation_id']}.jsonl"] = row["lines"]
        for row in await conn.fetch("SELECT response_id, lines::text FROM ksi_responses"):
            items[f"logs/responses/{row['response_id']}.jsonl"] = row["lines"]
        for row in await conn.fetch("SELECT agent_id, record::text FROM ksi_agents"):
            items[f"state/agents/{row['agent_id']}.json"] = row["record"]
        for row in await conn.fetch("SELECT name, (record::jsonb || jsonb_build_object('created', created))::text "
                                    "AS record FROM ksi_consortia"):
            items[f"state/consortia/{row['name']}.json"] = row["record"]
        for row in await conn.fetch("SELECT run_id, json_agg(record ORDER BY seq)::text AS lines "
                                    "FROM ksi_consortium_traces GROUP BY run_id"):
            items[f"logs/consortium/{row['run_id']}.jsonl"] = row["lines"]
        return dict(sorted(items.items()))
    finally:
        await conn.close()


async def hand_edit_meta(settings: Settings, conversation_id: str, **changes: Any) -> None:
    """Change stored metadata behind the daemon's back, as a person editing by hand would."""
    if settings.storage == "jsonl":
        path = settings.layout.meta_file(conversation_id)
        path.write_bytes(orjson.dumps({**orjson.loads(path.read_bytes()), **changes}))
        return
    assert settings.database_url is not None
    conn = await asyncpg.connect(settings.database_url.get_secret_value())
    try:
        meta = orjson.loads(await conn.fetchval(
            "SELECT meta::text FROM ksi_conversations WHERE conversation_id = $1", conversation_id))
        meta.update(changes)
        await conn.execute("UPDATE ksi_conversations SET meta = $2::json, parent_id = $3 WHERE conversation_id = $1",
                           conversation_id, orjson.dumps(meta).decode(), meta.get("parent_id"))
    finally:
        await conn.close()


def names(snapshot: dict[str, Any], prefix: str) -> set[str]:
    """The stored items under a layout prefix (`logs/responses/`), by their last name part."""
    return {name[len(prefix):] for name in snapshot if name.startswith(prefix)}


async def stored_items(settings: Settings) -> dict[str, Any]:
    """The snapshot parsed: a `.jsonl` item as its list of records, a `.json` item as its object."""
    parsed: dict[str, Any] = {}
    for name, value in (await stored_snapshot(settings)).items():
        if isinstance(value, bytes):  # a file: JSON lines or one JSON document
            parsed[name] = ([orjson.loads(line) for line in value.splitlines() if line.strip()]
                            if name.endswith(".jsonl") else orjson.loads(value))
        else:  # a row: already one JSON document (a list of lines for line-shaped items)
            parsed[name] = orjson.loads(value)
    return parsed
