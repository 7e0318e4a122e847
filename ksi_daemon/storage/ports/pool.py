"""The pool's ports: what daemons sharing one backend ask of it (events relayed, members, leases,
call slots and rates, requests), each with the implementation of a backend no other daemon shares
(`LocalOnly`, `SoleDaemon`, `OneDaemon*`). A backend whose table entry says `shared=False` uses
those; the contract suite runs the shared ones only for a backend that declares them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from ksi_common.timefmt import format_ts

RemoteDelivery = Callable[[str, dict[str, Any], dict[str, Any]], None]


class EventRelay(Protocol):
    """Events between daemons sharing a backend: this daemon's outcomes out, the others' in.

    A backend no other daemon shares has nothing to relay (`LocalOnly`)."""

    async def start(self, deliver: RemoteDelivery) -> None:
        """From now on, call `deliver(event, data, context)` for every event another daemon publishes."""
        ...

    def publish(self, event: str, data: dict[str, Any], context: dict[str, Any]) -> None:
        """Send an event to the other daemons; never waits."""
        ...

    async def stop(self) -> None: ...


class LocalOnly:
    """The relay of a backend no other daemon shares: nothing goes out, nothing comes in."""

    async def start(self, deliver: RemoteDelivery) -> None:
        return None

    def publish(self, event: str, data: dict[str, Any], context: dict[str, Any]) -> None:
        return None

    async def stop(self) -> None:
        return None


@dataclass(frozen=True, slots=True)
class DaemonInfo:
    """What a daemon says of itself when it registers: fixed for its whole run."""

    daemon_id: str  # random, made at start
    host: str
    pid: int
    version: str


@dataclass(frozen=True, slots=True)
class PoolMember:
    """One registered daemon as the registry saw it; times by the registry's clock (the database's
    for a shared one: the hosts' clocks are not compared)."""

    daemon_id: str
    host: str
    pid: int
    version: str
    started: str  # ISO-8601 UTC
    heartbeat_age: float  # seconds since its last heartbeat
    in_flight: int
    queued: int
    stale: bool  # no heartbeat for longer than the timeout asked
    leases: int = 0  # conversation leases it held (turns of its running there)


class DaemonRegistry(Protocol):
    """The daemons serving one backend. A backend no other daemon shares knows only this one."""

    @property
    def shared(self) -> bool:
        """True when other daemons may register too."""
        ...

    async def beat(self, me: DaemonInfo, uptime: float, in_flight: int, queued: int, leases: int) -> bool:
        """Record that `me` is alive now, with its load and the leases it holds; registers it (started `uptime` seconds
        ago) when it is not registered. True when it had to register."""
        ...

    async def members(self, stale_after: float, prune_after: float) -> list[PoolMember]:
        """Every registered daemon, earliest started first; those silent for longer than
        `prune_after` seconds are removed first."""
        ...

    async def leave(self, daemon_id: str) -> None:
        """Remove a daemon that stops cleanly."""
        ...


class SoleDaemon:
    """The registry of a backend no other daemon shares: this daemon, from memory."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock  # wall time: with no database, this host's clock is the only one
        self._me: PoolMember | None = None

    @property
    def shared(self) -> bool:
        return False

    async def beat(self, me: DaemonInfo, uptime: float, in_flight: int, queued: int, leases: int) -> bool:
        first = self._me is None
        started = self._me.started if self._me is not None else format_ts(self.clock() - uptime)
        self._me = PoolMember(me.daemon_id, me.host, me.pid, me.version, started, 0.0, in_flight, queued, False,
                              leases)
        return first

    async def members(self, stale_after: float, prune_after: float) -> list[PoolMember]:
        return [self._me] if self._me is not None else []

    async def leave(self, daemon_id: str) -> None:
        self._me = None


class ConversationLeases(Protocol):
    """Who may run a turn of a conversation now. Every turn takes its place in its conversation's
    line when it is accepted and runs only while it holds the conversation's lease, so turns run
    one at a time and in the order they were accepted, whichever daemon accepted each. A backend
    no other daemon shares has nothing to arbitrate (`OneDaemonLeases`): a daemon's own scheduler
    already runs a conversation's turns one after another."""

    async def line_up(self, conversation_id: str, request_id: str, record: dict[str, Any]) -> int:
        """Take the request's place in the conversation's line (before its ack leaves), keeping
        `record` (the whole request as accepted) beside it, for another daemon to run it should
        this one die; returns the place (a request taken over or claimed keeps the one it had)."""
        ...

    def hold(self, conversation_id: str, request_id: str) -> AbstractAsyncContextManager[bool]:
        """Wait until the request is first in line and the lease is free, then hold the lease for
        the block (renewed while it runs) and give it up, with the place in line, at its end.
        Yields False, holding nothing, for a request that left the line while it waited."""
        ...

    async def leave_line(self, conversation_id: str, request_id: str) -> None:
        """Give up the place of a request that ends without running (cancelled while queued)."""
        ...

    def held(self) -> int:
        """How many conversations' leases this daemon holds now."""
        ...

    async def in_line(self, conversation_id: str) -> int:
        """How many accepted turns of the conversation have not ended, whichever daemon runs them
        (0 where no other daemon shares the backend: the daemon's own requests are its count)."""
        ...

    def exclusive(self, key: str) -> AbstractAsyncContextManager[None]:
        """Held by one daemon at a time for `key`, over every daemon of the backend (a daemon
        alone has its own locks, and nothing to hold here)."""
        ...

    def let_ahead(self, conversation_id: str, request_id: str) -> None:
        """A turn with an earlier place joined this daemon's queue of the conversation ahead of
        this request: it stops asking for the lease, or, granted and not yet running, gives the lease
        back when its hold ends. Its place in line stays either way. A request doing neither is not
        affected: its next ask finds the earlier turn ahead of it."""
        ...


class OneDaemonLeases:
    """The leases of a backend no other daemon shares: every turn holds its conversation at once."""

    def __init__(self) -> None:
        self._places = 0

    async def line_up(self, conversation_id: str, request_id: str, record: dict[str, Any]) -> int:
        self._places += 1
        return self._places

    def held(self) -> int:
        return 0

    async def in_line(self, conversation_id: str) -> int:
        return 0

    @asynccontextmanager
    async def exclusive(self, key: str) -> AsyncIterator[None]:
        yield

    def let_ahead(self, conversation_id: str, request_id: str) -> None:
        return None

    @asynccontextmanager
    async def hold(self, conversation_id: str, request_id: str) -> AsyncIterator[bool]:
        yield True

    async def leave_line(self, conversation_id: str, request_id: str) -> None:
        return None


class CallSlots(Protocol):
    """Places for provider calls counted over every daemon of a backend: a scope (a model, or the
    whole pool) has `limit` of them. A backend no other daemon shares counts nothing here: the
    daemon's own semaphores are the whole count (`OneDaemonSlots`)."""

    def hold(self, scope: str, limit: int) -> AbstractAsyncContextManager[None]:
        """Wait for a free place of `scope` and hold it (renewed) for the block."""
        ...


class OneDaemonSlots:
    @asynccontextmanager
    async def hold(self, scope: str, limit: int) -> AsyncIterator[None]:
        yield


@dataclass(frozen=True, slots=True)
class RateDecision:
    """A call let through (`grant`, to settle its tokens) or refused (`retry_after` seconds)."""

    grant: int | None
    retry_after: float = 0.0


class CallRates(Protocol):
    """Calls and tokens per rolling minute, per model, over every daemon of a backend."""

    async def admit(self, model: str, per_minute: int | None, tokens_per_minute: int | None,
                    tokens: int) -> RateDecision:
        """Count a call of about `tokens` tokens when the minute has room for it, atomically."""
        ...

    async def settle(self, model: str, grant: int, tokens: int) -> None:
        """The tokens the call really took (its usage), once known."""
        ...


class OneDaemonRates:
    """The rates of a backend no other daemon shares: the minute's calls kept in memory."""

    WINDOW = 60.0

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock  # monotonic: one host measures its own minute
        self._calls: dict[str, dict[int, tuple[float, int]]] = {}  # model -> grant -> (at, tokens)
        self._next = 0

    async def admit(self, model: str, per_minute: int | None, tokens_per_minute: int | None,
                    tokens: int) -> RateDecision:
        now = self.clock()
        calls = self._calls.setdefault(model, {})
        for grant in [g for g, (at, _t) in calls.items() if at <= now - self.WINDOW]:
            del calls[grant]
        oldest = min((at for at, _t in calls.values()), default=now)
        if (per_minute is not None and len(calls) >= per_minute) or (
                tokens_per_minute is not None and calls and sum(t for _a, t in calls.values()) + tokens > tokens_per_minute):
            return RateDecision(None, round(max(0.0, oldest + self.WINDOW - now), 3))
        self._next += 1
        calls[self._next] = (now, tokens)
        return RateDecision(self._next)

    async def settle(self, model: str, grant: int, tokens: int) -> None:
        calls = self._calls.get(model, {})
        if grant in calls:
            calls[grant] = (calls[grant][0], tokens)


@dataclass(frozen=True, slots=True)
class PoolRequest:
    """A request accepted by some daemon of the pool, as the backend keeps it."""

    request_id: str
    conversation_id: str
    daemon_id: str  # the daemon running it
    status: str  # queued (until it ends), done, failed, cancelled
    response_id: str | None
    record: dict[str, Any]  # the request as accepted
    code: str | None = None  # why it failed or was cancelled
    indexed: bool = False  # its exchange is in its conversation's index (done, whatever the status says)


class PoolRequests(Protocol):
    """The requests every daemon of a backend accepted (lined up with `ConversationLeases.line_up`):
    their ends, a look-up by id from any daemon, and the takeover of a dead daemon's. A backend no
    other daemon shares knows none but the daemon's own, in memory (`OneDaemonRequests`)."""

    def ended(self, request_id: str, status: str, code: str | None) -> None:
        """Record a request's end; never waits (written in the background, in order)."""
        ...

    async def find(self, request_id: str) -> PoolRequest | None: ...

    async def ask_cancel(self, request_id: str) -> PoolRequest | None:
        """Ask the daemon running the request to cancel it; the request as found (None: unknown)."""
        ...

    async def cancels_asked(self) -> list[str]:
        """Requests of this daemon that another daemon was asked to cancel, and not yet ended."""
        ...

    async def take_over(self, stale_after: float) -> list[PoolRequest]:
        """Unfinished requests of daemons silent for `stale_after` seconds, now this daemon's: each
        `indexed` or not, as stored after the lease of its conversation was taken from them."""
        ...

    async def offer(self, request_id: str) -> bool:
        """Offer a request of this daemon waiting for a call slot to the daemons with a free one;
        False when there is nobody to offer it to (or the offer could not be made)."""
        ...

    async def withdraw(self, request_id: str) -> bool:
        """Take an offer back before running the request here; False when another daemon claimed it."""
        ...

    async def claim_offered(self, skip_models: Sequence[str] = ()) -> PoolRequest | None:
        """The oldest request another daemon offered (in the order of the lines), now this daemon's;
        its daemon is told, and the lease it held for it is revoked. None: nothing is offered.
        `skip_models`: models whose slots here are all taken; a request of one would only wait."""
        ...

    def watch(self, heard: Callable[[str, str], None]) -> None:
        """Call `heard("offered", "")` when some daemon offers a request, `heard("taken", request_id)`
        when a request was claimed (before the listening starts)."""
        ...

    async def flush(self) -> None:
        """Wait until every end recorded so far is written."""
        ...


class OneDaemonRequests:
    def ended(self, request_id: str, status: str, code: str | None) -> None:
        return None

    async def find(self, request_id: str) -> PoolRequest | None:
        return None

    async def ask_cancel(self, request_id: str) -> PoolRequest | None:
        return None

    async def cancels_asked(self) -> list[str]:
        return []

    async def take_over(self, stale_after: float) -> list[PoolRequest]:
        return []

    async def offer(self, request_id: str) -> bool:
        return False

    async def withdraw(self, request_id: str) -> bool:
        return True

    async def claim_offered(self, skip_models: Sequence[str] = ()) -> PoolRequest | None:
        return None

    def watch(self, heard: Callable[[str, str], None]) -> None:
        return None

    async def flush(self) -> None:
        return None
