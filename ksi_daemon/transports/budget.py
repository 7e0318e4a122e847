"""One budget of client connections for every door: each connection holds a descriptor, and the
process has a fixed number of them, shared with its files, its database pool and its provider
sockets. A connection past the budget is answered `too_many_connections` by its door and closed;
one that got in never makes the daemon fail to open a file or reach a provider."""

from __future__ import annotations

import resource

# Descriptors kept for everything but client connections (logs, conversation files, the database
# pool, provider connections, the listeners): a quarter of the limit, from 64 up to 256, so a
# low limit still leaves most of itself to clients.
RESERVE_SHARE = 4
RESERVE_BOUNDS = (64, 256)
BACKLOG_BOUNDS = (16, 1024)
# The share of the cap only the Unix socket may use: its clients are this machine's own users,
# HTTP connections are opened by anyone who reaches the port, no token needed until a request.
LOCAL_SHARE = 4


def raised_descriptor_limit() -> int | None:
    """The process's descriptor limit, its soft limit raised to the hard one first; None when unlimited."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return None if soft == resource.RLIM_INFINITY else soft


class ConnectionBudget:
    """How many client connections every door together may hold, and each listener's backlog."""

    def __init__(self, wanted: int, listeners: int, limit: int | None) -> None:
        if limit is None:
            self.backlog, self.cap = BACKLOG_BOUNDS[1], wanted
        else:
            # an event loop accepts up to a backlog's worth of connections in one go, before any of
            # them can be refused: every listener's backlog stays outside the cap as well
            self.backlog = max(BACKLOG_BOUNDS[0], min(BACKLOG_BOUNDS[1], limit // (8 * listeners)))
            reserve = max(RESERVE_BOUNDS[0], min(RESERVE_BOUNDS[1], limit // RESERVE_SHARE))
            self.cap = max(1, min(wanted, limit - listeners * self.backlog - reserve))
        self.local_room = self.cap // LOCAL_SHARE
        self.held = 0

    @classmethod
    def for_process(cls, wanted: int, listeners: int) -> ConnectionBudget:
        """The budget this process's descriptor limit allows, capped at `wanted`."""
        return cls(wanted, listeners, raised_descriptor_limit())

    def take(self, leave: int = 0) -> bool:
        """Hold one connection, leaving `leave` free for others; False when that is not possible
        (the door refuses the connection)."""
        if self.held + leave >= self.cap:
            return False
        self.held += 1
        return True

    def give_back(self) -> None:
        self.held -= 1
