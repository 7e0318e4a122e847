"""`completion:wait`, `status` and `cancel` for a request another daemon of the pool accepted: read
from the pool's record of requests (`PoolRequests`), the result rebuilt from storage once the
request is done, wherever it ran. A backend no other daemon shares knows no such request:
`request_not_found`, as before."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.reading import StoredReader
from ksi_common.request_status import FINISHED
from ksi_daemon.services.completion.recovery import indexed_result
from ksi_daemon.services.completion.request_view import pool_view
from ksi_daemon.storage.ports import PoolRequest, PoolRequests, ResponseStore

POLL = 0.1  # seconds between two looks at a request another daemon runs, while a wait lasts
CANCEL_WAIT = 10.0  # seconds a cancel waits for the daemon running the request to end it


class RequestsElsewhere:
    def __init__(self, requests: PoolRequests, conversations: StoredReader, responses: ResponseStore,
                 daemon_id: str = "") -> None:
        self.requests = requests
        self.daemon_id = daemon_id  # this daemon's
        self.conversations = conversations
        self.responses = responses

    async def _find(self, request_id: str) -> PoolRequest:
        found = await self.requests.find(request_id)
        if found is None:
            raise KsiError(ErrorCode.REQUEST_NOT_FOUND, f"no request {request_id}", request_id=request_id)
        return found

    async def knows(self, request_id: str) -> bool:
        """Whether the pool holds the request (a shared backend: any live daemon answers for it)."""
        try:
            return await self.requests.find(request_id) is not None
        except KsiError:  # the database is away: the journal's own account stands
            return False

    async def taken_from_here(self, request_id: str) -> bool:
        """Whether another daemon took the request over from this one."""
        try:
            found = await self.requests.find(request_id)
        except KsiError:
            return False
        return found is not None and found.daemon_id != self.daemon_id

    async def wait(self, request_id: str, timeout: float) -> dict[str, Any]:
        """The result once done (or its failure); the status when the wait ends before."""
        deadline = time.monotonic() + timeout
        found = await self._find(request_id)
        while not self._ended(found) and time.monotonic() < deadline:
            await asyncio.sleep(min(POLL, max(0.0, deadline - time.monotonic())))
            found = await self._find(request_id)
        result = None
        if found.indexed:
            line = {"request_id": found.request_id, "response_id": found.response_id,
                    "conversation_id": found.conversation_id}
            result = await indexed_result(line, self.conversations, self.responses)
        return pool_view(found, result).outcome()

    async def status(self, request_id: str) -> dict[str, Any]:
        return pool_view(await self._find(request_id)).describe()

    async def cancel(self, request_id: str) -> dict[str, Any]:
        found = await self.requests.ask_cancel(request_id)
        if found is None:
            raise KsiError(ErrorCode.REQUEST_NOT_FOUND, f"no request {request_id}", request_id=request_id)
        deadline = time.monotonic() + CANCEL_WAIT
        while not self._ended(found) and time.monotonic() < deadline:
            await asyncio.sleep(POLL)
            found = await self._find(request_id)
        return {**pool_view(found).describe(), "cancelled": found.status == "cancelled"}

    @staticmethod
    def _ended(found: PoolRequest) -> bool:
        return found.indexed or found.status in FINISHED
