"""The requests the completion service knows: state, waiting, and bounded history."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.request_status import RequestStatus
from ksi_common.timefmt import utc_now
from ksi_daemon.context import EventContext
from ksi_daemon.services.completion.models import CompletionAsync
from ksi_daemon.services.completion.request_view import RequestView
from ksi_daemon.services.completion.scheduler import Job


@dataclass(eq=False)
class RequestState:
    request_id: str
    conversation_id: str
    model: str
    request: CompletionAsync
    context: EventContext
    agent_id: str | None = None
    from_agent: str | None = None
    status: RequestStatus = RequestStatus.QUEUED
    # another daemon of the pool took it over (a pool movement, not a status): it answers for the
    # request, whose status here stays the last this daemon knew (queued or running)
    handed_over: bool = False
    created: str = field(default_factory=utc_now)
    started_at: float | None = None
    job: Job | None = None
    response_id: str | None = None
    result: dict[str, Any] | None = None
    error: KsiError | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    # the conversation was made for this request under an id of the daemon's: should the request
    # fail before anything is stored there, no empty conversation is left behind
    made_conversation: bool = False
    images: list[dict[str, Any]] = field(default_factory=list)  # stored image parts of the new input
    # the ids of its conversation's pending input it was matched by at admission: its new input
    takes_pending: tuple[str, ...] = ()

    def finish(self, status: RequestStatus, result: dict[str, Any] | None = None,
               error: KsiError | None = None) -> None:
        # whatever spelling a caller used, the state holds a member: its readers compare members
        self.status, self.result, self.error = RequestStatus(status), result, error
        self.done.set()

    def duration_ms(self) -> float:
        return round((time.perf_counter() - self.started_at) * 1000, 2) if self.started_at else 0.0

    def view(self, queue_position: int = 0) -> RequestView:
        """This request as completion:status and completion:wait see it, running or finished;
        `queue_position` is the scheduler's, while it is queued."""
        return RequestView(self.request_id, self.conversation_id, self.status, model=self.model,
                           created=self.created, queue_position=queue_position,
                           # a request that never ran has no response
                           response_id=self.response_id if self.started_at is not None else None,
                           reason=self.error.code if self.error is not None else None, result=self.result,
                           error=self._failure())

    def _failure(self) -> KsiError | None:
        """The error a wait raises, naming this request."""
        if self.error is None or self.status not in (RequestStatus.FAILED, RequestStatus.CANCELLED):
            return None
        return KsiError(self.error.code, self.error.message, **{**self.error.details, "request_id": self.request_id})


class RequestRegistry:
    """Live requests plus the most recent finished ones (bounded)."""

    def __init__(self, keep_finished: int) -> None:
        self.keep_finished = keep_finished
        self._live: dict[str, RequestState] = {}
        # live requests per conversation: admission and every finish ask, and counting them over
        # all live requests cost a walk over every request in flight each time
        self._live_in: dict[str, int] = {}
        # what is kept of a finished request (its view: never its job, task, context or input)
        self._finished: OrderedDict[str, RequestView] = OrderedDict()
        # live requests by response id: a request continuing after a response asks whether it still runs
        self._live_responses: dict[str, RequestState] = {}

    def add(self, state: RequestState) -> None:
        if state.request_id not in self._live:
            self._live_in[state.conversation_id] = self._live_in.get(state.conversation_id, 0) + 1
        self._live[state.request_id] = state
        if state.response_id is not None:
            self._live_responses[state.response_id] = state

    def retire(self, state: RequestState) -> None:
        self._drop_response(state)
        if self._live.pop(state.request_id, None) is not None:
            left = self._live_in[state.conversation_id] - 1
            if left:
                self._live_in[state.conversation_id] = left
            else:
                del self._live_in[state.conversation_id]
        self.add_finished(state.view())

    def add_finished(self, view: RequestView) -> None:
        """A request that ended here, or that the previous daemon left (in place of one of the same id)."""
        self._finished[view.request_id] = view
        while len(self._finished) > self.keep_finished:
            self._finished.popitem(last=False)

    def get(self, request_id: str) -> RequestState | RequestView:
        found = self._live.get(request_id) or self._finished.get(request_id)
        if found is None:
            raise KsiError(ErrorCode.REQUEST_NOT_FOUND, f"no request {request_id}", request_id=request_id)
        return found

    def live_state(self, request_id: str) -> RequestState | None:
        """The request when it is queued or running here."""
        return self._live.get(request_id)

    def finished(self, request_id: str) -> RequestView | None:
        """The request when it ended here or in the previous run; None for one this daemon never ran."""
        return self._finished.get(request_id)

    def forget(self, request_id: str) -> None:
        """Drop a request another daemon runs now: it answers for it."""
        state = self._live.pop(request_id, None)
        if state is not None:
            self._drop_response(state)

    def _drop_response(self, state: RequestState) -> None:
        if state.response_id is not None and self._live_responses.get(state.response_id) is state:
            del self._live_responses[state.response_id]

    def live_response(self, response_id: str) -> RequestState | None:
        """The live request that answers with `response_id`, when one is queued or running here."""
        return self._live_responses.get(response_id)

    def live(self) -> list[RequestState]:
        return list(self._live.values())

    def count_live(self, conversation_id: str) -> int:
        return self._live_in.get(conversation_id, 0)
