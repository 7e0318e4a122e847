"""After a restart: what became of the requests the previous run left unfinished."""

from __future__ import annotations

from typing import Any

from ksi_common.events import completion_result
from ksi_common.items import output_items
from ksi_common.reading import StoredReader
from ksi_common.request_status import FINISHED, PENDING
from ksi_common.timefmt import utc_now
from ksi_daemon.storage.ports import RequestJournal, ResponseStore

KEPT = 10_000  # recovered requests remembered across restarts


async def recover(journal: RequestJournal, conversations: StoredReader,
                  responses: ResponseStore) -> list[dict[str, Any]]:
    """Every request the journal knows, finished ones as they ended and unfinished ones now failed
    with `daemon_restart` (or done when their exchange was indexed); the journal is compacted to
    the most recent of them, so `completion:status` still answers for them after a restart."""
    interrupted, finished = [], []
    indexed: dict[str, dict[str, int]] = {}  # conversation -> its indexed response ids, read once
    for line in await journal.states():
        if line.get("status") in FINISHED:
            finished.append(line)
            continue
        if line.get("status") not in PENDING:  # `running`: journals of earlier versions
            continue
        # Killed after the index line was written but before `done` was journaled: the
        # exchange is in the history, so the request is done (a retry would duplicate it).
        result = await indexed_result(line, conversations, responses, indexed)
        if result is not None:
            interrupted.append({**line, "status": "done", "recovered": True, "result": result, "ts": utc_now()})
        else:
            interrupted.append({**line, "status": "failed", "code": "daemon_restart", "ts": utc_now()})
    kept = (finished + interrupted)[-KEPT:]
    await journal.replace(kept)
    return kept


async def indexed_result(line: dict[str, Any], conversations: StoredReader, responses: ResponseStore,
                         indexed: dict[str, dict[str, int]] | None = None) -> dict[str, Any] | None:
    """The result data of a journaled request whose exchange made it into its index, else None;
    `indexed` keeps each conversation's index as read, for a caller asking about many requests."""
    response_id, conversation_id = line.get("response_id"), line.get("conversation_id")
    if not response_id or not conversation_id:
        return None
    numbers = indexed.get(conversation_id) if indexed is not None else None
    if numbers is None:
        numbers = {e.response_id: e.n for e in await conversations.entries(conversation_id)}
        if indexed is not None:
            indexed[conversation_id] = numbers
    n = numbers.get(response_id)
    if n is None:
        return None
    record = await responses.read(response_id)
    if record is None or not record.ok or record.outcome is None:
        return None
    outcome = record.outcome
    agent_id = next((i.get("agent_id") for i in record.inputs if i.get("agent_id")), None)
    return completion_result(
        request_id=line["request_id"], response_id=response_id, conversation_id=conversation_id,
        agent_id=agent_id, model=outcome.get("model"), content=record.content, output=output_items(outcome),
        finish_reason=outcome.get("finish_reason"), usage=outcome.get("usage") or {}, cost=outcome.get("cost"),
        history={}, attempts=len(outcome.get("attempts") or []), duration_ms=outcome.get("duration_ms"),
        exchange=n or None, recovered=True)
