"""The status of a completion request, one set for the daemon, the doors and the CLI."""

from __future__ import annotations

from enum import StrEnum


class RequestStatus(StrEnum):
    """What completion:status and completion:wait report; a member equals its wire string."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


# still to answer: a wait that ends in one of these ended before the result
PENDING = frozenset({RequestStatus.QUEUED, RequestStatus.RUNNING})
# ended for good: the result, or the failure, is what a wait gets
FINISHED = frozenset({RequestStatus.DONE, RequestStatus.FAILED, RequestStatus.CANCELLED})
