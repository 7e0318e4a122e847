"""The PostgreSQL backend as one `Storage`: every store over one pool, the schema migrated on open,
the relay of events between daemons, and the pool's shared work: conversation leases (one turn at
a time), call slots and rates (limits over every daemon), and the accepted requests (takeover).

The request journal stays a file in this daemon's own var dir: it is this daemon's state alone
(like its pid file), the restarted daemon finds it there, and a synchronous local append is what
lets a request be journaled on the hot path. The pool's copy of each request is written with its
place in line before its ack (leases.py); its end is copied there from the journal, in the
background (journal.py). Recovery asks the database whether an interrupted request's exchange was
indexed."""

from __future__ import annotations

from typing import Any

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.ids import random_hex
from ksi_common.settings import Settings
from ksi_daemon.storage.jsonl.journal import JsonlJournal
from ksi_daemon.storage.postgres.blobs import PostgresBlobs
from ksi_daemon.storage.postgres.conversations import PostgresConversations
from ksi_daemon.storage.postgres.daemons import PostgresDaemons
from ksi_daemon.storage.postgres.database import Database
from ksi_daemon.storage.postgres.journal import PooledJournal
from ksi_daemon.storage.postgres.leases import PostgresLeases
from ksi_daemon.storage.postgres.rates import PostgresRates
from ksi_daemon.storage.postgres.records import (
    PostgresAgents,
    PostgresCalibration,
    PostgresConsortia,
    PostgresResponses,
    PostgresSummaries,
    PostgresTraces,
)
from ksi_daemon.storage.postgres.relay import PostgresRelay
from ksi_daemon.storage.postgres.requests import PostgresRequests
from ksi_daemon.storage.postgres.schema import SCHEMA_VERSION
from ksi_daemon.storage.postgres.slots import PostgresSlots


class PostgresStorage:
    def __init__(self, settings: Settings) -> None:
        if settings.database_url is None:
            raise KsiError(ErrorCode.STORAGE_ERROR, "KSI_STORAGE=postgres needs KSI_DATABASE_URL (postgresql://...)",
                           setting="database_url")
        self.database = Database(settings.database_url.get_secret_value())
        # made at each start: the pool lists this daemon by it, and the relay marks its own events with it
        self.daemon_id = random_hex(12)
        # a turn holds its conversation's lease; an exchange is appended only under the lease held
        self.leases = PostgresLeases(self.database, self.daemon_id, settings.pool_lease)
        self.conversations = PostgresConversations(self.database, fence=self.leases.fence)
        # limits over every daemon of the database: call slots, and each model's calls per minute
        self.slots = PostgresSlots(self.database, self.daemon_id, settings.pool_lease)
        self.rates = PostgresRates(self.database)
        self.responses = PostgresResponses(self.database)
        self.agents = PostgresAgents(self.database)
        self.consortia = PostgresConsortia(self.database)
        self.traces = PostgresTraces(self.database)
        self.summaries = PostgresSummaries(self.database)
        self.calibration = PostgresCalibration(self.database)
        self.blobs = PostgresBlobs(self.database)
        # the requests every daemon accepted: each one's end copied there from this daemon's journal
        self.relay = PostgresRelay(self.database, self.daemon_id)
        self.requests = PostgresRequests(self.database, self.daemon_id, self.relay)
        self.journal = PooledJournal(JsonlJournal(settings.layout), self.requests)
        self.daemons = PostgresDaemons(self.database)

    async def open(self) -> None:
        await self.database.open()

    async def close(self) -> None:
        try:
            await self.journal.close()
        finally:
            await self.relay.stop()
            await self.database.close()

    def describe(self) -> dict[str, Any]:
        migration = self.database.migration
        return {
            "backend": "postgres",
            "url": self.database.shown_url,
            "schema_version": migration.after if migration else None,
            "supported_schema_version": SCHEMA_VERSION,
            "daemon_id": self.daemon_id,
            "database_calls": self.database.calls,
            "events_published": self.relay.published,
            "events_received": self.relay.received,
            "lease_waits": self.leases.waits,
            "slot_waits": self.slots.waits,
            "requests_taken_over": self.requests.taken_over,
            "requests_stolen": self.requests.stolen,
        }
