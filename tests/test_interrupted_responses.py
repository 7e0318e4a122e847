"""completion:chunks for a background response a restart interrupted: the answer a kept chunk log
gives, with no chunks, and its status, times and error from the request's one view (the journal
line of the previous run, or the pool's row of the request)."""

from __future__ import annotations

from typing import Any

from ksi_common.errors import ErrorCode
from ksi_common.timefmt import parse_ts
from ksi_daemon.context import EventContext
from ksi_daemon.services.completion.models import CompletionAsync
from ksi_daemon.services.completion.request_view import journal_view
from ksi_daemon.services.completion.requests import RequestState
from ksi_daemon.services.completion.streams import ChunkLogs, CompletionChunks
from ksi_daemon.services.pool.interrupted import InterruptedResponses
from ksi_daemon.storage.ports import OneDaemonRequests, PoolRequest

QUEUED_AT, ENDED_AT = "2026-01-01T00:00:00Z", "2026-01-01T00:00:05Z"
LOST = {"request_id": "r1", "conversation_id": "c1", "status": "failed", "code": "daemon_restart",
        "response_id": "resp-1", "model": "openai/stub-slow", "queued_at": QUEUED_AT, "ts": ENDED_AT}


class Rows(OneDaemonRequests):
    """A pool whose rows are set by the test, one after another for the same request: each
    `find` reads the next (the last stays)."""

    def __init__(self, *rows: PoolRequest) -> None:
        self.rows = list(rows)

    async def find(self, request_id: str) -> PoolRequest | None:
        row = self.rows[0] if self.rows else None
        if len(self.rows) > 1:
            self.rows.pop(0)
        return row if row is not None and row.request_id == request_id else None


def row(status: str = "queued", **fields: Any) -> PoolRequest:
    record = {"model": "openai/stub-model", "agent_id": "a1", "created": QUEUED_AT,
              "request": {"prompt": "go", "background": True, "temperature": 0.5}}
    base: dict[str, Any] = {"request_id": "r2", "conversation_id": "c2", "daemon_id": "d2", "status": status,
                            "response_id": "resp-2", "record": record}
    return PoolRequest(**{**base, **fields})


async def live_answer() -> dict[str, Any]:
    logs = ChunkLogs()
    state = RequestState(request_id="r0", conversation_id="c0", model="m", response_id="resp-0",
                         request=CompletionAsync(prompt="go", background=True), context=EventContext.root())
    logs.open(state)
    return await logs.read(CompletionChunks(response_id="resp-0"))


async def test_a_lost_response_is_answered_as_a_kept_log_is_failed_by_the_restart() -> None:
    interrupted = InterruptedResponses(OneDaemonRequests())
    interrupted.add(LOST, pooled=False)
    answer = await interrupted.view("resp-1", wait=0)
    assert answer is not None and answer.keys() == (await live_answer()).keys()
    assert answer["request"].keys() == (await live_answer())["request"].keys()
    expected = journal_view(LOST)
    assert expected.error is not None
    assert (answer["status"], answer["error"]) == ("failed", expected.error.to_wire())
    assert answer["error"]["code"] == ErrorCode.DAEMON_RESTART
    assert (answer["created"], answer["ended"]) == (parse_ts(QUEUED_AT), parse_ts(ENDED_AT))
    assert (answer["chunks"], answer["total_chunks"], answer["result"]) == ([], 0, None)
    assert (answer["model"], answer["response_id"], answer["request_id"]) == ("openai/stub-slow", "resp-1", "r1")
    assert await interrupted.view("resp-other", wait=0) is None


async def test_a_pooled_response_shows_the_pool_row_and_the_request_it_keeps() -> None:
    interrupted = InterruptedResponses(Rows(row()))
    interrupted.add({**LOST, "request_id": "r2", "response_id": "resp-2", "code": "daemon_restart"}, pooled=True)
    answer = await interrupted.view("resp-2", wait=0)
    assert answer is not None and answer.keys() == (await live_answer()).keys()
    assert (answer["status"], answer["error"], answer["ended"]) == ("queued", None, None)
    assert answer["created"] == parse_ts(QUEUED_AT)
    assert (answer["model"], answer["agent_id"], answer["request"]["temperature"]) == ("openai/stub-model", "a1", 0.5)


async def test_a_pooled_response_failed_elsewhere_carries_the_rows_code() -> None:
    interrupted = InterruptedResponses(Rows(row("failed", code="provider_error")))
    interrupted.add({**LOST, "request_id": "r2", "response_id": "resp-2"}, pooled=True)
    answer = await interrupted.view("resp-2", wait=0)
    assert answer is not None and answer["status"] == "failed"
    assert answer["error"]["code"] == "provider_error"
    assert answer["error"]["details"] == {"request_id": "r2", "daemon_id": "d2"}


async def test_a_reader_waiting_on_a_queued_pooled_response_gets_the_row_read_again() -> None:
    interrupted = InterruptedResponses(Rows(row(), row("cancelled", code="cancelled")))
    interrupted.add({**LOST, "request_id": "r2", "response_id": "resp-2"}, pooled=True)
    answer = await interrupted.view("resp-2", wait=0.01)
    assert answer is not None and answer["status"] == "cancelled" and answer["error"]["code"] == "cancelled"


async def test_a_pooled_response_done_or_indexed_is_left_to_its_stored_record() -> None:
    for done in (row("done"), row(indexed=True)):
        interrupted = InterruptedResponses(Rows(done))
        interrupted.add({**LOST, "request_id": "r2", "response_id": "resp-2"}, pooled=True)
        assert await interrupted.view("resp-2", wait=0) is None
    unknown = InterruptedResponses(Rows())  # the pool no longer knows it (or is away)
    unknown.add({**LOST, "request_id": "r2", "response_id": "resp-2"}, pooled=True)
    assert await unknown.view("resp-2", wait=0) is None
