"""One view of a request from each source: what completion:status (`describe`) and completion:wait
(`outcome`) answer for a request of the previous daemon's journal, a pool row of another daemon,
and a request of this daemon, running or ended."""

from __future__ import annotations

import pytest

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.request_status import RequestStatus
from ksi_daemon.context import EventContext
from ksi_daemon.services.completion.models import CompletionAsync
from ksi_daemon.services.completion.request_view import journal_view, pool_view
from ksi_daemon.services.completion.requests import RequestState
from ksi_daemon.storage.ports import PoolRequest


def test_a_journal_request_left_unfinished_is_failed_by_the_restart() -> None:
    view = journal_view({"request_id": "r1", "conversation_id": "c", "status": "failed", "code": "daemon_restart"})
    assert view.status is RequestStatus.FAILED
    assert view.describe() == {"request_id": "r1", "conversation_id": "c", "status": "failed",
                               "reason": "daemon_restart", "queue_position": 0}
    with pytest.raises(KsiError) as raised:
        view.outcome()
    assert raised.value.code == ErrorCode.DAEMON_RESTART and raised.value.details == {"request_id": "r1"}
    assert raised.value.message == "the request was interrupted by a daemon restart"


def test_a_journal_request_cancelled_before_the_restart_says_so() -> None:
    view = journal_view({"request_id": "r1", "conversation_id": "c", "status": "cancelled", "code": "cancelled"})
    assert view.describe()["status"] == "cancelled"
    with pytest.raises(KsiError, match=r"ended cancelled \(cancelled\) before the daemon restarted"):
        view.outcome()
    with pytest.raises(KsiError):  # asked again: raised again, the same
        view.outcome()


def test_a_journal_request_done_answers_with_its_rebuilt_result_or_its_response() -> None:
    line = {"request_id": "r1", "conversation_id": "c", "status": "done", "response_id": "resp-1"}
    waiting = journal_view(line)
    assert waiting.outcome() == {"request_id": "r1", "conversation_id": "c", "status": "done",
                                 "response_id": "resp-1", "queue_position": 0, "recovered": True}
    result = {"request_id": "r1", "content": "hi", "recovered": True}
    assert journal_view({**line, "result": result}).outcome() is result


def _row(**fields: object) -> PoolRequest:
    base: dict[str, object] = {"request_id": "r1", "conversation_id": "c", "daemon_id": "d2", "status": "queued",
                               "response_id": "resp-1", "record": {"model": "openai/stub-model"}}
    return PoolRequest(**{**base, **fields})  # type: ignore[arg-type]


def test_a_pool_row_names_its_daemon_and_its_response_once_indexed() -> None:
    queued = pool_view(_row()).describe()
    assert queued == {"request_id": "r1", "conversation_id": "c", "status": "queued", "queue_position": 0,
                      "model": "openai/stub-model", "daemon_id": "d2"}
    assert pool_view(_row()).outcome() == queued  # a wait that ends before the request
    indexed = pool_view(_row(indexed=True), {"content": "hi"})  # done, whatever the row's status says
    assert indexed.describe()["status"] == "done" and indexed.describe()["response_id"] == "resp-1"
    assert indexed.outcome() == {"content": "hi"}


def test_a_pool_row_failed_on_another_daemon_raises_its_code() -> None:
    view = pool_view(_row(status="failed", code="provider_error"))
    assert view.describe()["reason"] == "provider_error"
    with pytest.raises(KsiError) as raised:
        view.outcome()
    assert raised.value.code == "provider_error" and raised.value.details == {"request_id": "r1", "daemon_id": "d2"}
    with pytest.raises(KsiError) as unknown:  # ended without a code: an internal error
        pool_view(_row(status="cancelled")).outcome()
    assert unknown.value.code == ErrorCode.INTERNAL_ERROR


def _state() -> RequestState:
    return RequestState(request_id="r1", conversation_id="c", model="m", request=CompletionAsync(prompt="hi"),
                        context=EventContext(event_id="e"), response_id="resp-1", created="2026-01-01T00:00:00Z")


def test_a_request_of_this_daemon_has_no_response_until_it_ran() -> None:
    state = _state()
    assert state.view(queue_position=3).describe() == {
        "request_id": "r1", "conversation_id": "c", "status": "queued", "queue_position": 3,
        "created": "2026-01-01T00:00:00Z", "model": "m"}
    state.started_at = 1.0
    state.finish("done", {"content": "hi"})
    assert state.view().describe()["response_id"] == "resp-1" and state.view().outcome() == {"content": "hi"}


def test_a_request_of_this_daemon_that_failed_raises_naming_it() -> None:
    state = _state()
    state.finish("cancelled", error=KsiError(ErrorCode.CANCELLED, "cancelled while queued", where="queue"))
    view = state.view()
    assert view.describe()["reason"] == "cancelled" and "response_id" not in view.describe()
    with pytest.raises(KsiError) as raised:
        view.outcome()
    assert raised.value.details == {"where": "queue", "request_id": "r1"}


def test_a_journal_request_knows_its_model_and_when_it_was_accepted_and_ended() -> None:
    line = {"request_id": "r1", "conversation_id": "c", "status": "failed", "code": "daemon_restart",
            "model": "openai/stub-model", "queued_at": "2026-01-01T00:00:00Z", "ts": "2026-01-01T00:00:05Z"}
    view = journal_view(line)
    assert (view.model, view.created, view.ended) == ("openai/stub-model", "2026-01-01T00:00:00Z",
                                                      "2026-01-01T00:00:05Z")
    described = view.describe()
    assert described["model"] == "openai/stub-model" and described["created"] == "2026-01-01T00:00:00Z"
    assert "ended" not in described  # completion:status reports no end time, from any source


def test_a_pool_row_knows_when_its_request_was_accepted() -> None:
    view = pool_view(_row(record={"model": "m", "created": "2026-01-01T00:00:00Z"}))
    assert view.describe()["created"] == "2026-01-01T00:00:00Z" and view.ended is None


def test_a_request_of_this_daemon_holds_a_status_member_whatever_spelling_ended_it() -> None:
    state = _state()
    state.finish("failed", error=KsiError(ErrorCode.TIMEOUT, "slow"))
    assert state.status is RequestStatus.FAILED and state.view().status is RequestStatus.FAILED
    assert not state.handed_over  # a pool movement, kept apart from the status
