"""HTTP connections within the daemon's budget: uvicorn's h11 protocol, told to refuse a connection
past the budget with the daemon's error shape (uvicorn's own limit answers plain text, and only
once a request arrived) and to close a connection whose request head, or whose request body once
its head came, does not arrive in time."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import h11
import orjson
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from ksi_common.errors import ErrorCode, KsiError
from ksi_daemon.transports.budget import ConnectionBudget
from ksi_daemon.transports.http.errors import error_body, error_headers, status_of

# A refused connection is read (and what it sends dropped) for this long before it is closed: a
# socket closed with unread input is reset, and the client may then never read the answer.
REFUSED_LINGER = 1.0


def raw_response(error: KsiError, status: int | None = None) -> bytes:
    """A whole HTTP/1.1 response carrying `error` in the daemon's shape, closing the connection."""
    status = status or status_of(error)
    body = orjson.dumps(error_body(error))
    head = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", "content-type: application/json",
            f"content-length: {len(body)}", "connection: close"]
    head.extend(f"{name}: {value}" for name, value in error_headers(error).items())
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class _Lingering:
    """Refused connections waiting to be closed; at most `limit` at once, the rest closed at once."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.count = 0


@dataclass(frozen=True, slots=True)
class _Limits:
    """What one HTTP front's connections are held to."""

    budget: ConnectionBudget
    lingering: _Lingering
    head_timeout: float
    body_timeout: float


class BudgetedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol within a connection budget and request deadlines (`limits`, set on
    the subclass `budgeted_protocol` makes: uvicorn builds a protocol from its class alone)."""

    limits: _Limits

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.holds_budget = False
        self.head_deadline: asyncio.TimerHandle | None = None
        self.body_deadline: asyncio.TimerHandle | None = None
        self.linger: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        if not self.limits.budget.take(leave=self.limits.budget.local_room):
            self._refuse(transport)  # type: ignore[arg-type]
            return
        self.holds_budget = True
        super().connection_made(transport)  # type: ignore[arg-type]
        self._await_head()

    def _refuse(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        limit = self.limits.budget.cap - self.limits.budget.local_room
        transport.write(raw_response(KsiError(
            ErrorCode.TOO_MANY_CONNECTIONS, f"the daemon serves at most {limit} HTTP connections; retry later",
            limit=limit, retry_after=1.0)))
        if self.limits.lingering.count >= self.limits.lingering.limit or not transport.can_write_eof():
            transport.close()
            return
        self.limits.lingering.count += 1
        transport.write_eof()
        self.linger = self.loop.call_later(REFUSED_LINGER, transport.close)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.linger is not None:
            self.linger.cancel()
            self.linger = None
            self.limits.lingering.count -= 1
        if not self.holds_budget:
            return
        self.holds_budget = False
        self.limits.budget.give_back()
        self._head_arrived()
        self._body_arrived()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self.holds_budget:
            return  # a refused connection's request: read and dropped
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:
            self._await_head()  # a head begun (the first, or the next on a kept-alive connection)
        else:
            self._head_arrived()
        if self.conn.their_state is h11.SEND_BODY:
            self._await_body()  # a whole body within the timeout: a byte now and then keeps nothing open
        else:
            self._body_arrived()

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        # the WebSocket protocol takes the transport over, and this connection's place with it
        self.holds_budget = False
        self._head_arrived()
        super().handle_websocket_upgrade(event)

    def eof_received(self) -> bool | None:  # type: ignore[override]
        if not self.holds_budget:
            return False  # the client read the refusal and left: close now
        return super().eof_received()

    def _await_head(self) -> None:
        if self.head_deadline is None and not self.transport.is_closing():
            self.head_deadline = self.loop.call_later(self.limits.head_timeout, self._head_too_slow)

    def _head_arrived(self) -> None:
        if self.head_deadline is not None:
            self.head_deadline.cancel()
            self.head_deadline = None

    def _head_too_slow(self) -> None:
        self.head_deadline = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.trailing_data[0]:  # part of a head came: say why the connection ends
            self.transport.write(raw_response(KsiError(
                ErrorCode.TIMEOUT, f"the request head did not arrive within {self.limits.head_timeout:g} s",
                timeout=self.limits.head_timeout), HTTPStatus.REQUEST_TIMEOUT.value))
        self.transport.close()

    def _await_body(self) -> None:
        if self.body_deadline is None and not self.transport.is_closing():
            self.body_deadline = self.loop.call_later(self.limits.body_timeout, self._body_too_slow)

    def _body_arrived(self) -> None:
        if self.body_deadline is not None:
            self.body_deadline.cancel()
            self.body_deadline = None

    def _body_too_slow(self) -> None:
        self.body_deadline = None
        if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return
        if self.cycle is None or not self.cycle.response_started:  # else the answer is under way: cut it
            self.transport.write(raw_response(KsiError(
                ErrorCode.TIMEOUT,
                f"the request body did not arrive within {self.limits.body_timeout:g} s of its head",
                timeout=self.limits.body_timeout), HTTPStatus.REQUEST_TIMEOUT.value))
        self.transport.close()


def budgeted_protocol(budget: ConnectionBudget, head_timeout: float, body_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol class bound to `budget` and deadlines for request heads and bodies."""
    limits = _Limits(budget, _Lingering(budget.backlog), head_timeout, body_timeout)
    return type("BudgetedH11Protocol", (BudgetedH11Protocol,), {"limits": limits})


def budgeted_ws_protocol(budget: ConnectionBudget) -> type[WebSocketsSansIOProtocol]:
    """uvicorn's WebSocket protocol for connections upgraded from budgeted HTTP ones: each holds its
    HTTP connection's place in `budget` and gives it back when the socket closes."""

    class BudgetedWebSocketProtocol(WebSocketsSansIOProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.holds_budget = True  # made only by an upgrade, which handed the place over

        def connection_lost(self, exc: Exception | None) -> None:
            try:
                super().connection_lost(exc)
            finally:
                if self.holds_budget:
                    self.holds_budget = False
                    budget.give_back()

    return BudgetedWebSocketProtocol
