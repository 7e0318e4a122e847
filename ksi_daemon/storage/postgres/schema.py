"""The database schema, as numbered migrations applied in order (never edited once released).

Conversations keep their metadata as one JSON document (the same model the JSONL files hold) plus
the columns that queries need: `head` (the highest exchange number written, the key of the
conditional append), `version` (bumped on every metadata write, so a cache can tell whether its
copy is current) and `tokens` (the running sum of history-eligible tokens up to `head`).

Each exchange row stores `tokens_before`, the running sum of eligible tokens of every earlier
exchange of its conversation. "The newest exchanges within a budget B" is then the range
`tokens_before >= total - B` of the index on (conversation_id, tokens_before): a range scan whose
length follows the budget, never the conversation's length.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    description: str
    statements: tuple[str, ...]


MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "conversations, exchanges, responses, agents, consortia, traces, request journal", (
        """
        CREATE TABLE ksi_conversations (
            conversation_id text PRIMARY KEY,
            meta json,  -- NULL: an index without metadata (imported from an old var dir)
            version bigint NOT NULL DEFAULT 1,
            head integer NOT NULL DEFAULT 0,
            base integer NOT NULL DEFAULT 0,
            tokens bigint NOT NULL DEFAULT 0,
            parent_id text,
            last_activity text
        )
        """,
        "CREATE INDEX ksi_conversations_parent ON ksi_conversations (parent_id) WHERE parent_id IS NOT NULL",
        """
        CREATE TABLE ksi_exchanges (
            conversation_id text NOT NULL,
            n integer NOT NULL,
            response_id text NOT NULL,
            ts text,
            model text,
            provider text,
            agent_id text,
            tokens_in integer NOT NULL DEFAULT 0,
            tokens_out integer NOT NULL DEFAULT 0,
            is_feedback boolean NOT NULL DEFAULT false,
            run_id text,
            tokens_before bigint NOT NULL,
            PRIMARY KEY (conversation_id, n)
        )
        """,
        "CREATE INDEX ksi_exchanges_budget ON ksi_exchanges (conversation_id, tokens_before)",
        "CREATE INDEX ksi_exchanges_response ON ksi_exchanges (response_id)",
        """
        CREATE TABLE ksi_responses (
            response_id text PRIMARY KEY,
            conversation_id text,
            lines json NOT NULL,  -- json, not jsonb: the lines keep their key order
            written timestamptz NOT NULL DEFAULT now()
        )
        """,
        "CREATE INDEX ksi_responses_conversation ON ksi_responses (conversation_id)",
        """
        CREATE TABLE ksi_agents (
            agent_id text PRIMARY KEY,
            record json NOT NULL,
            version bigint NOT NULL DEFAULT 1
        )
        """,
        """
        CREATE TABLE ksi_consortia (
            name text PRIMARY KEY,
            record json NOT NULL,
            created text NOT NULL  -- kept when a definition is replaced
        )
        """,
        """
        CREATE TABLE ksi_consortium_traces (
            run_id text NOT NULL,
            seq bigserial,
            record json NOT NULL,
            PRIMARY KEY (run_id, seq)
        )
        """,
        """
        CREATE TABLE ksi_request_journal (
            daemon_id text NOT NULL,
            request_id text NOT NULL,
            conversation_id text,
            status text NOT NULL,
            response_id text,
            line jsonb NOT NULL,
            PRIMARY KEY (daemon_id, request_id)
        )
        """,
        """
        CREATE TABLE ksi_relayed_events (
            id bigserial PRIMARY KEY,
            payload json NOT NULL,
            sent timestamptz NOT NULL DEFAULT now()
        )
        """,
    )),
    Migration(2, "compaction summaries and model calibration; the request journal moves to each daemon's var dir", (
        """
        CREATE TABLE ksi_summaries (
            conversation_id text NOT NULL,
            seq bigserial,
            upto integer NOT NULL,
            record json NOT NULL,
            PRIMARY KEY (conversation_id, seq)
        )
        """,
        """
        CREATE TABLE ksi_calibration (
            id boolean PRIMARY KEY DEFAULT true CHECK (id),  -- one document, replaced whole
            ratios json NOT NULL
        )
        """,
        "DROP TABLE ksi_request_journal",
    )),
    Migration(3, "the daemons serving the database, each with its last heartbeat", (
        # times are the database's own (now()): the daemons' hosts may disagree about the time
        """
        CREATE TABLE ksi_daemons (
            daemon_id text PRIMARY KEY,
            host text NOT NULL,
            pid integer NOT NULL,
            version text NOT NULL,
            started timestamptz NOT NULL,
            heartbeat timestamptz NOT NULL,
            in_flight integer NOT NULL DEFAULT 0,
            queued integer NOT NULL DEFAULT 0
        )
        """,
    )),
    Migration(4, "content-addressed blobs (the images of requests), each content stored once", (
        # only the bytes: the media type is the referring record's (one content, one row)
        """
        CREATE TABLE ksi_blobs (
            sha256 text PRIMARY KEY,
            size bigint NOT NULL,
            data bytea NOT NULL
        )
        """,
    )),
    Migration(5, "each exchange's chained content digest, looked up to find a client-held history's conversation", (
        "ALTER TABLE ksi_exchanges ADD COLUMN digest text",
        "CREATE INDEX ksi_exchanges_digest ON ksi_exchanges (digest) WHERE digest IS NOT NULL",
    )),
    Migration(6, "one turn at a time per conversation across daemons: the line of accepted turns and the lease", (
        # a turn's place in its conversation's line, taken when it is accepted: tickets in order
        """
        CREATE TABLE ksi_turn_line (
            ticket bigserial PRIMARY KEY,
            conversation_id text NOT NULL,
            request_id text NOT NULL UNIQUE,
            daemon_id text NOT NULL
        )
        """,
        "CREATE INDEX ksi_turn_line_conversation ON ksi_turn_line (conversation_id, ticket)",
        # one row per conversation ever turned, never deleted: its generation only grows, so a
        # daemon holding an old one (paused past its expiry) is fenced off for good
        """
        CREATE TABLE ksi_leases (
            conversation_id text PRIMARY KEY,
            request_id text NOT NULL,
            daemon_id text NOT NULL,
            generation bigint NOT NULL,
            expires_at timestamptz NOT NULL
        )
        """,
    )),
    Migration(7, "limits over every daemon: call slots held with an expiry, and each model's calls of the last minute", (
        # place `slot` (0 .. limit - 1) of a scope (a model, or the whole pool) while a call holds it
        """
        CREATE TABLE ksi_call_slots (
            scope text NOT NULL,
            slot integer NOT NULL,
            daemon_id text NOT NULL,
            expires_at timestamptz NOT NULL,
            PRIMARY KEY (scope, slot)
        )
        """,
        """
        CREATE TABLE ksi_call_rates (
            grant_id bigserial PRIMARY KEY,
            model text NOT NULL,
            at timestamptz NOT NULL DEFAULT now(),
            tokens integer NOT NULL
        )
        """,
        "CREATE INDEX ksi_call_rates_model ON ksi_call_rates (model, at)",
    )),
    Migration(8, "accepted requests, whole, with the daemon that runs them: any daemon answers for them or takes them over", (
        """
        CREATE TABLE ksi_requests (
            request_id text PRIMARY KEY,
            conversation_id text NOT NULL,
            daemon_id text NOT NULL,  -- the daemon running it now (the one that took it over, after one died)
            status text NOT NULL,  -- queued until it ends: done, failed or cancelled
            response_id text,
            record json NOT NULL,  -- the request as accepted, enough for another daemon to run it
            code text,
            cancel_asked boolean NOT NULL DEFAULT false,
            accepted timestamptz NOT NULL DEFAULT now(),
            finished timestamptz,
            taken_from text
        )
        """,
        "CREATE INDEX ksi_requests_open ON ksi_requests (daemon_id) WHERE finished IS NULL",
        "CREATE INDEX ksi_requests_finished ON ksi_requests (finished) WHERE finished IS NOT NULL",
    )),
    Migration(9, "work goes where there is room: a daemon at its limits offers its waiting turns to the others", (
        # set while the turn waits for a call slot on its daemon; a daemon with a free one claims it
        "ALTER TABLE ksi_requests ADD COLUMN offered boolean NOT NULL DEFAULT false",
        "CREATE INDEX ksi_requests_offered ON ksi_requests (request_id) WHERE offered AND finished IS NULL",
        # the conversation leases each daemon held at its last heartbeat, for the pool's list
        "ALTER TABLE ksi_daemons ADD COLUMN leases integer NOT NULL DEFAULT 0",
    )),
)

SCHEMA_VERSION = MIGRATIONS[-1].version
