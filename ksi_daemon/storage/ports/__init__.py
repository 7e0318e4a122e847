"""The storage ports: what services may ask of storage, in domain types (never a path).

Every backend (JSONL under `var/`, PostgreSQL) implements these Protocols; the composition root
picks one by name (`ksi_common.storage_backends`) and services see only the ports. Every method is a coroutine:
a backend does its blocking work off the event loop (JSONL) or over an async driver (PostgreSQL).

Several daemons may share one backend (PostgreSQL), so the writes that could collide are
conditional: appending exchange n fails when n is taken (`ExchangeConflict`, the caller reloads
the head and retries), and creating a conversation or an agent is an exclusive create
(`ConversationExists`, `AgentExists`). A cache asks `moved_since()` whether the history moved under
it when `shared` says another daemon may write.

Read-only access, shared with the `ksi` inspection commands, is `ksi_common.reading.StoredReader`;
a conversation store is also such a reader, so the daemon and the CLI read through the same code.

The ports live in one module per group (conversations, records, blobs, pool); this package is
their public face, and `Storage` gathers one backend's stores.
"""

from __future__ import annotations

from typing import Any, Protocol

from ksi_daemon.storage.ports.blobs import (
    BlobRef,
    BlobStore,
    damaged_blob,
)
from ksi_daemon.storage.ports.conversations import (
    ConversationExists,
    ConversationStore,
    DigestMatch,
    ExchangeConflict,
    StoredTail,
)
from ksi_daemon.storage.ports.pool import (
    CallRates,
    CallSlots,
    ConversationLeases,
    DaemonInfo,
    DaemonRegistry,
    EventRelay,
    LocalOnly,
    OneDaemonLeases,
    OneDaemonRates,
    OneDaemonRequests,
    OneDaemonSlots,
    PoolMember,
    PoolRequest,
    PoolRequests,
    RateDecision,
    RemoteDelivery,
    SoleDaemon,
)
from ksi_daemon.storage.ports.records import (
    AgentExists,
    AgentStore,
    CalibrationStore,
    ConsortiumStore,
    RequestJournal,
    ResponseStore,
    SummaryStore,
    TraceStore,
)


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


__all__ = ["AgentExists", "AgentStore", "BlobRef", "BlobStore", "CalibrationStore", "CallRates", "CallSlots", "ConsortiumStore", "ConversationExists", "ConversationLeases", "ConversationStore", "DaemonInfo", "DaemonRegistry", "DigestMatch", "EventRelay", "ExchangeConflict", "LocalOnly", "OneDaemonLeases", "OneDaemonRates", "OneDaemonRequests", "OneDaemonSlots", "PoolMember", "PoolRequest", "PoolRequests", "RateDecision", "RemoteDelivery", "RequestJournal", "ResponseStore", "SoleDaemon", "StoredTail", "SummaryStore", "TraceStore", "damaged_blob", "Storage"]
