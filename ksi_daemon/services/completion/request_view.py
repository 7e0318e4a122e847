"""One view of a completion request, whatever it was read from: a request running or finished here
(`RequestState.view`), one the previous daemon's journal left (`journal_view`), or the pool's row
of one another daemon accepted (`pool_view`). `describe()` is what completion:status answers,
`outcome()` what completion:wait does, and a background response a restart interrupted is shown by
completion:chunks from its view too (`services/pool/interrupted.py`); the result data itself is
built by `ksi_common.events.completion_result` alone."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.request_status import RequestStatus
from ksi_daemon.storage.ports import PoolRequest

RESTART_MESSAGE = "the request was interrupted by a daemon restart"


@dataclass(frozen=True, slots=True, eq=False)
class RequestView:
    """A request as completion:status and completion:wait see it. What a source does not know is
    None and left out of `describe()`. Thousands of finished ones are kept: no job, task, context
    or input, which a garbage collection would walk."""

    request_id: str
    conversation_id: str | None
    status: RequestStatus
    model: str | None = None
    created: str | None = None  # when it was accepted: the request's, its journal line's or its pool record's
    # when it ended, where its source keeps that (the journal); completion:chunks shows it, status does not
    ended: str | None = None
    response_id: str | None = None  # once it ran: a request that never ran has no response
    reason: str | None = None  # the error code of a failed or cancelled request
    queue_position: int = 0
    recovered: bool = False  # its result was read back from storage, not run by this daemon
    daemon_id: str | None = None  # the daemon of the pool that holds it
    result: dict[str, Any] | None = None  # completion:result's data, once done
    error: KsiError | None = None  # what a wait raises, once failed or cancelled

    def describe(self) -> dict[str, Any]:
        """completion:status's answer."""
        description: dict[str, Any] = {"request_id": self.request_id, "conversation_id": self.conversation_id,
                                        "status": self.status.value, "queue_position": self.queue_position}
        if self.created is not None:
            description["created"] = self.created
        if self.model is not None:
            description["model"] = self.model
        if self.response_id is not None:
            description["response_id"] = self.response_id
        if self.reason is not None:
            description["reason"] = self.reason
        if self.recovered:
            description["recovered"] = True
        if self.daemon_id is not None:
            description["daemon_id"] = self.daemon_id
        return description

    def outcome(self) -> dict[str, Any]:
        """The result data when done; raises the failure when failed or cancelled; else the status."""
        if self.result is not None:
            return self.result
        if self.error is not None:  # a new error each time: one raised again would pile up tracebacks
            raise KsiError(self.error.code, self.error.message, **self.error.details)
        return self.describe()


def journal_view(record: dict[str, Any]) -> RequestView:
    """A request of the previous daemon, as its journal left it after recovery: done (its result
    rebuilt from storage, or not yet), or failed or cancelled (`daemon_restart` when unfinished)."""
    request_id, conversation_id = record["request_id"], record.get("conversation_id")
    # its lines are merged: `queued_at` is its first one's time, `ts` its last one's (its end)
    known = {"model": record.get("model"), "created": record.get("queued_at"), "ended": record.get("ts")}
    if record.get("status") == RequestStatus.DONE:
        return RequestView(request_id, conversation_id, RequestStatus.DONE, response_id=record.get("response_id"),
                           recovered=True, result=record.get("result"), **known)
    code = str(record.get("code") or ErrorCode.DAEMON_RESTART)
    message = (RESTART_MESSAGE if code == ErrorCode.DAEMON_RESTART
               else f"the request ended {record.get('status')} ({code}) before the daemon restarted")
    status = RequestStatus.CANCELLED if record.get("status") == RequestStatus.CANCELLED else RequestStatus.FAILED
    return RequestView(request_id, conversation_id, status, reason=code,
                       error=KsiError(code, message, request_id=request_id), **known)


def pool_view(row: PoolRequest, result: dict[str, Any] | None = None) -> RequestView:
    """A request another daemon of the pool accepted, from the pool's row; `result` when its
    exchange is indexed and was read back from storage."""
    status = RequestStatus.DONE if row.indexed else RequestStatus(row.status)  # indexed: done, whatever the row says
    error = None
    if row.status in (RequestStatus.FAILED, RequestStatus.CANCELLED):
        code = row.code or ErrorCode.INTERNAL_ERROR
        error = KsiError(code, f"the request ended {row.status} ({code}) on another daemon of the pool",
                         request_id=row.request_id, daemon_id=row.daemon_id)
    return RequestView(row.request_id, row.conversation_id, status, model=row.record.get("model"),
                       created=row.record.get("created"),
                       response_id=row.response_id if status is RequestStatus.DONE else None,
                       reason=row.code, daemon_id=row.daemon_id, result=result, error=error)
