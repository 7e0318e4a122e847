"""The request journal of a daemon on PostgreSQL: its own file in its var dir (see storage.py), and
each request's end copied to the pool's record of the request, so every daemon can answer for it
and none takes over a request that ended."""

from __future__ import annotations

from typing import Any

from ksi_daemon.storage.jsonl.journal import JsonlJournal
from ksi_daemon.storage.postgres.requests import PostgresRequests

ENDS = frozenset({"done", "failed", "cancelled"})


class PooledJournal:
    def __init__(self, local: JsonlJournal, requests: PostgresRequests) -> None:
        self.local = local
        self.requests = requests

    def record(self, request_id: str, conversation_id: str, status: str, response_id: str | None = None,
               code: str | None = None, model: str | None = None) -> None:
        self.local.record(request_id, conversation_id, status, response_id=response_id, code=code, model=model)
        if status in ENDS:
            self.requests.ended(request_id, status, code)

    async def states(self) -> list[dict[str, Any]]:
        return await self.local.states()

    async def replace(self, lines: list[dict[str, Any]]) -> None:
        await self.local.replace(lines)

    async def close(self) -> None:
        try:
            await self.requests.flush()
        finally:
            await self.local.close()
