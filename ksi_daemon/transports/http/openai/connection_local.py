"""Responses that are connection-local: made on a WebSocket with `store: false`, or warm-ups
(`generate: false`). KSI stores the exchange of the first kind like any other, but, as on OpenAI,
only the socket that made one may chain from it: this registry is how every other socket, and
every HTTP request, tells that such an id is not theirs to continue."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from ksi_common.errors import ErrorCode, KsiError
from ksi_daemon.transports.http.openai.response_object import ksi_id

# ids remembered after their socket closed, so that a reconnect is told previous_response_not_found
# for them; the oldest are forgotten first
REMEMBERED_LOCAL = 100_000


class LocalResponses:
    """Which response ids were connection-local (made with `store: false`, or warm-ups), across
    every socket of this door: one of them named on another socket is not found, as on OpenAI."""

    def __init__(self, limit: int = REMEMBERED_LOCAL) -> None:
        self.limit = limit
        self._ids: OrderedDict[str, None] = OrderedDict()

    def add(self, response_id: str) -> None:
        self._ids[response_id] = None
        while len(self._ids) > self.limit:
            self._ids.popitem(last=False)

    def __contains__(self, response_id: object) -> bool:
        return response_id in self._ids

    def refuse(self, previous: str, where: str) -> KsiError:
        return KsiError(ErrorCode.PREVIOUS_RESPONSE_NOT_FOUND,
                        f"previous response {previous} was connection-local (store: false or a warm-up) and {where}: "
                        "send the full context instead", fields={"previous_response_id": "connection-local"})

    def check(self, previous: Any) -> None:
        """A request that is not on a WebSocket chains from no connection-local response."""
        if isinstance(previous, str) and ksi_id(previous) in self:
            raise self.refuse(previous, "is held by the WebSocket that made it only")
