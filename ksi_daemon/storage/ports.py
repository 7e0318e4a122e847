"""The storage ports: what services may ask of storage, in domain types (never a path).

Every backend (JSONL under `var/`, PostgreSQL) implements these Protocols; the composition root
picks one by name (`backends.py`) and services see only the ports. Every method is a coroutine:
a backend does its blocking work off the event loop (JSONL) or over an async driver (PostgreSQL).

Several daemons may share one backend (PostgreSQL), so the writes that could collide are
conditional: appending exchange n fails when n is taken (`ExchangeConflict`, the caller reloads
the head and retries), and creating a conversation or an agent is an exclusive create
(`ConversationExists`, `AgentExists`). A cache asks `moved_since()` whether the history moved under
it when `shared` says another daemon may write.

Read-only access, shared with the `ksi` inspection commands, is `ksi_common.reading.StoredReader`;
a conversation store is also such a reader, so the daemon and the CLI read through the same code.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.reading import StoredReader
from ksi_common.records import IndexEntry, ResponseRecord
from ksi_common.summaries import Summary
from ksi_common.timefmt import format_ts
from ksi_daemon.storage.models import AgentRecord, ConversationMeta


class ExchangeConflict(Exception):
    """Exchange `n` is taken (another writer appended first): reload the head and retry."""

    def __init__(self, conversation_id: str, n: int, head: int) -> None:
        super().__init__(f"exchange {n} of {conversation_id} is taken; the head is {head}")
        self.conversation_id = conversation_id
        self.n = n
        self.head = head


@dataclass(frozen=True, slots=True)
class StoredTail:
    """A conversation as stored now: its metadata (None when it is gone), the newest entries
    within a token budget (oldest first) and its head."""

    meta: ConversationMeta | None
    entries: list[IndexEntry]
    head: int


@dataclass(frozen=True, slots=True)
class DigestMatch:
    """An exchange whose chained digest is the one looked up."""

    conversation_id: str
    n: int


class ConversationExists(Exception):
    """An exclusive create found the conversation already there."""

    def __init__(self, conversation_id: str) -> None:
        super().__init__(f"conversation {conversation_id} already exists")
        self.conversation_id = conversation_id


class AgentExists(Exception):
    """An exclusive create found the agent record already there."""

    def __init__(self, agent_id: str) -> None:
        super().__init__(f"agent {agent_id} already exists")
        self.agent_id = agent_id


class ConversationStore(StoredReader, Protocol):
    """Conversations: metadata, the exchange index, and the lifecycle moves of both."""

    @property
    def shared(self) -> bool:
        """True when another daemon may write the same conversations (caches must check `head`)."""
        ...

    async def exists(self, conversation_id: str) -> bool:
        """Whether the conversation has metadata or an index."""
        ...

    async def create(self, meta: ConversationMeta, *, durable_with_first_exchange: bool = False) -> None:
        """Exclusive create: raises `ConversationExists` when the id is taken (metadata or index).

        `durable_with_first_exchange`: created for a request, so nothing is promised about it
        before that request's result; a backend that syncs its writes may make it durable
        together with the first exchange instead of on its own.
        """
        ...

    async def load_meta(self, conversation_id: str) -> ConversationMeta | None:
        """The metadata; an index without metadata gets a minimal record; None when neither exists."""
        ...

    async def save_meta(self, meta: ConversationMeta) -> None:
        """Replace the metadata of an existing conversation (last writer wins)."""
        ...

    async def head(self, conversation_id: str) -> int:
        """The number of the last indexed exchange (0 when none); cheap: no history is read."""
        ...

    async def moved_since(self, conversation_id: str, head: int, token_budget: int) -> StoredTail | None:
        """None while the stored head is still `head`; else the conversation as stored now, its
        tail within `token_budget` (as `read_tail`). A shared backend answers both in one round
        trip: a cache holding a conversation another daemon moved reloads it in that one."""
        ...

    async def append_exchange(self, conversation_id: str, entry: IndexEntry, *,
                              response: list[dict[str, Any]] | None = None,
                              meta: ConversationMeta | None = None) -> None:
        """Conditional append of one exchange, durable before it returns: first its response
        record (`response`, the record's lines, when given: kept as is if an earlier attempt of
        this append wrote it), then the index line of `entry`, then `meta` replaces the metadata.

        Refused with `ExchangeConflict` when an exchange numbered `entry.n` or later is already
        indexed: no index line and no metadata are written; the caller reloads the head and
        the metadata, renumbers, and calls again with the same response.
        """
        ...

    async def read_tail(self, conversation_id: str, token_budget: int) -> tuple[list[IndexEntry], int]:
        """The newest non-feedback entries whose token counts fit the budget (oldest first) and the
        head; the cost follows the budget, not the length of the conversation."""
        ...

    async def find_digest(self, digest: str) -> list[DigestMatch]:
        """Every stored exchange whose chained digest is `digest` (a fork's shared exchanges are its
        parent's); the cost does not follow the number of stored conversations."""
        ...

    async def move(self, conversation_id: str, new_id: str, note: dict[str, Any]) -> list[str]:
        """Move a whole conversation (index and metadata) to `new_id`, noting `note` in its
        metadata's `extra`; forks of it follow it. Returns the forks repointed. Response records
        are untouched (they are named by response id)."""
        ...

    async def adopt(self, conversation_id: str, source_id: str, meta: ConversationMeta, replaced: int = 0) -> bool:
        """The exchanges of `source_id` (index, summaries) become those of `conversation_id`,
        in place of the `replaced` exchanges it holds (the source holds copies of them); `meta`
        replaces its metadata, the source's response records name it from then on and the source
        is removed. False, and nothing changed, when `conversation_id` does not hold exactly
        `replaced` exchanges or the source is gone. The replaced exchanges' response records stay,
        indexed nowhere, until the conversation is deleted."""
        ...

    async def discard_unused(self, conversation_id: str) -> bool:
        """Remove a conversation that holds no exchange (made for a request that failed before
        any was stored), its response records left as they are; False, and nothing removed, when
        it holds one (another writer's, perhaps)."""
        ...

    async def delete(self, conversation_id: str) -> list[str]:
        """Delete the index, the metadata and the response records that belong to the
        conversation and to no other index. Returns what was removed, as names of the stored
        items (JSONL: paths relative to the var dir)."""
        ...

    async def import_conversation(self, meta: ConversationMeta,
                                  exchanges: list[tuple[IndexEntry, list[dict[str, Any]]]]) -> None:
        """Create a conversation whole from imported exchanges (entry, response-record lines):
        exclusive like `create`; its response records are new ones."""
        ...


class ResponseStore(Protocol):
    """Response records: one per request, the raw inputs then the outcome, written whole once."""

    async def write(self, response_id: str, lines: list[dict[str, Any]]) -> None:
        """Write a new record, durable before it returns; never overwrites an existing one."""
        ...

    async def read(self, response_id: str) -> ResponseRecord | None: ...

    async def read_many(self, response_ids: list[str]) -> list[ResponseRecord | None]:
        """Records in the order asked, None for a missing one; one round trip where it can."""
        ...

    async def ids(self) -> list[str]:
        """Every stored response id, sorted (indexed or not: failed requests, consortium calls)."""
        ...


class AgentStore(Protocol):
    async def create(self, record: AgentRecord) -> None:
        """Exclusive create: raises `AgentExists` when a record with this id exists."""
        ...

    async def save(self, record: AgentRecord) -> None:
        """Replace the record of an existing agent."""
        ...

    async def load(self, agent_id: str) -> AgentRecord | None: ...

    async def load_all(self) -> list[AgentRecord]:
        """Every readable record; a damaged one is logged and skipped, never fatal."""
        ...


class ConsortiumStore(Protocol):
    """Saved consortium definitions, by name (names are validated by the caller)."""

    async def save(self, name: str, definition: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """Write or replace a definition; returns the stored record and whether one was replaced."""
        ...

    async def load(self, name: str) -> dict[str, Any] | None: ...

    async def load_all(self) -> dict[str, dict[str, Any]]: ...

    async def remove(self, name: str) -> bool: ...


class TraceStore(Protocol):
    """Consortium run traces: one append-only sequence of lines per run."""

    async def append(self, run_id: str, line: dict[str, Any], durable: bool = False) -> None: ...

    async def read(self, run_id: str) -> list[dict[str, Any]] | None:
        """The run's lines in order; None for an unknown run."""
        ...

    async def run_ids(self) -> list[str]:
        """Every run with a trace, sorted."""
        ...


class RequestJournal(Protocol):
    """Request states, so work interrupted by a crash is reported after a restart.

    `record` is called on the hot path and must not block the loop: an implementation may
    buffer and write in the background (lines of one request stay in order). Each daemon has
    its own journal: a shared backend keys it by the daemon's identity.
    """

    def record(self, request_id: str, conversation_id: str, status: str, response_id: str | None = None,
               code: str | None = None, model: str | None = None) -> None:
        """A state of a request; its `queued` line names its model, what a response interrupted by a
        crash is shown with after the restart."""
        ...

    async def states(self) -> list[dict[str, Any]]:
        """The last state of every request the journal holds, in journal order (the lines of a
        request merged, later fields winning): finished ones and the ones left queued or running."""
        ...

    async def replace(self, lines: list[dict[str, Any]]) -> None:
        """Compact the journal to exactly `lines` (the requests kept after a recovery)."""
        ...

    async def close(self) -> None: ...


class SummaryStore(Protocol):
    """Compaction summaries: per conversation, appended in order (each covers exchanges 1..upto)."""

    async def append(self, summary: Summary) -> None: ...

    async def read(self, conversation_id: str) -> list[Summary]:
        """The conversation's summaries, oldest first; a damaged one is skipped."""
        ...


@dataclass(frozen=True, slots=True)
class BlobRef:
    """Bytes a blob store holds: their sha256 (the key), their length, and the media type the
    caller stored them as (a reference carries it; the store keeps only the bytes)."""

    sha256: str
    media_type: str
    size: int

    def to_record(self) -> dict[str, Any]:
        """The reference as a stored part names it (see ksi_common.items)."""
        return {"sha256": self.sha256, "media_type": self.media_type, "bytes": self.size}


def damaged_blob(sha256: str, where: str) -> KsiError:
    """The error of a blob whose bytes no longer have their hash (never sent to a model as they are)."""
    return KsiError(ErrorCode.STORAGE_ERROR, f"the stored bytes sha256:{sha256} are damaged (they no longer "
                    "have that hash)", sha256=sha256, stored_in=where)


class BlobStore(Protocol):
    """Content-addressed bytes (images of requests): each content stored once, by its sha256.

    A blob is never changed or removed by the daemon: conversations sharing an image share its
    blob, so deleting one conversation leaves it (`ksi doctor` lists blobs no record names)."""

    async def put(self, data: bytes, media_type: str) -> BlobRef:
        """Store `data` unless the same content is stored already; durable before it returns."""
        ...

    async def get(self, sha256: str) -> bytes | None:
        """The stored bytes, or None when no blob has this hash."""
        ...

    async def has(self, sha256: str) -> bool: ...

    async def ids(self) -> list[str]:
        """Every stored hash, sorted."""
        ...


class CalibrationStore(Protocol):
    """Learned token-count ratios per model, kept across restarts (replaced whole)."""

    async def load(self) -> dict[str, dict[str, Any]]:
        """{model: {ratio, samples, tightened}}; empty when none or unreadable."""
        ...

    async def save(self, ratios: dict[str, dict[str, Any]]) -> None: ...
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
        """Stop waiting for the lease for this request (a turn with an earlier place joined this
        daemon's queue of the conversation); its place in line stays."""
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


class Storage(Protocol):
    """One backend: every store, opened and closed together."""

    conversations: ConversationStore
    responses: ResponseStore
    agents: AgentStore
    consortia: ConsortiumStore
    traces: TraceStore
    journal: RequestJournal
    summaries: SummaryStore
    calibration: CalibrationStore
    blobs: BlobStore
    relay: EventRelay
    daemons: DaemonRegistry
    leases: ConversationLeases
    slots: CallSlots
    rates: CallRates
    requests: PoolRequests
    daemon_id: str  # this daemon among those sharing the backend: random, made when the backend is built

    async def open(self) -> None:
        """Connect and prepare (directories, schema); raises `KsiError(storage_unavailable)`."""
        ...

    async def close(self) -> None: ...

    def describe(self) -> dict[str, Any]:
        """What `system:health` shows under `storage` (secrets masked)."""
        ...
