-- +goose Up
-- The outbox table: the product's public contract (see SCHEMA.md in the design).
-- All objects are created unqualified, so they land in the first schema of the
-- connection's search_path: set search_path to keep them out of "public".
CREATE TABLE messaging_outbox (
    message_id          text        NOT NULL,
    destination         text        NOT NULL,
    payload             bytea       NOT NULL,
    headers             jsonb       NOT NULL DEFAULT '{}'::jsonb,
    status              text        NOT NULL DEFAULT 'PENDING',
    seq                 bigint      GENERATED ALWAYS AS IDENTITY,
    created_at          timestamptz NOT NULL DEFAULT now(),
    occurred_at         timestamptz,
    published_at        timestamptz,
    attempts            integer     NOT NULL DEFAULT 0,
    next_attempt_at     timestamptz,
    lease_owner         text,
    lease_token         bigint      NOT NULL DEFAULT 0,
    lease_expires_at    timestamptz,
    last_failure_code   text,
    last_failure_detail text,
    last_attempt_at     timestamptz,
    producer            text,
    correlation_id      text,
    causation_id        text,
    tenant              text,
    partition_key       text,
    ordering_key        text,
    traceparent         text,
    tracestate          text,
    baggage             text,
    schema_subject      text,
    schema_version      text,
    content_type        text,
    message_type        text,
    aggregate_type      text,
    aggregate_id        text,
    aggregate_version   bigint,
    parked_at           timestamptz,
    -- The one key rule both relays (polling and CDC) read: the downstream key
    -- is the partition key when the producer set one, else the message id, so
    -- unkeyed messages spread over partitions instead of piling onto one.
    routing_key         text GENERATED ALWAYS AS (COALESCE(partition_key, message_id)) STORED,
    CONSTRAINT messaging_outbox_pkey PRIMARY KEY (message_id),
    CONSTRAINT messaging_outbox_message_id_not_empty CHECK (message_id <> ''),
    CONSTRAINT messaging_outbox_destination_not_empty CHECK (destination <> ''),
    CONSTRAINT messaging_outbox_status_check
        CHECK (status IN ('PENDING', 'IN_FLIGHT', 'PUBLISHED', 'AMBIGUOUS', 'FAILED', 'EXHAUSTED')),
    CONSTRAINT messaging_outbox_tenant_check
        CHECK (tenant IS NULL OR tenant ~ '^[a-z0-9][a-z0-9._-]{0,63}$'),
    CONSTRAINT messaging_outbox_headers_object CHECK (jsonb_typeof(headers) = 'object'),
    CONSTRAINT messaging_outbox_attempts_check CHECK (attempts >= 0)
);

-- Serves the claim: rows a relay may pick, in seq order
--   WHERE status IN ('PENDING','AMBIGUOUS','IN_FLIGHT') ... ORDER BY seq LIMIT n FOR UPDATE SKIP LOCKED
-- IN_FLIGHT is included on purpose: a relay that died mid-publish leaves its
-- rows there, and they must be found again when the lease expires.
CREATE INDEX messaging_outbox_claimable_idx ON messaging_outbox (seq)
    WHERE status IN ('PENDING', 'AMBIGUOUS', 'IN_FLIGHT');

-- Serves retention: PUBLISHED rows older than the horizon, oldest first
--   WHERE status = 'PUBLISHED' AND published_at < $cutoff ORDER BY published_at LIMIT n
CREATE INDEX messaging_outbox_published_idx ON messaging_outbox (published_at)
    WHERE status = 'PUBLISHED';

-- Serves per-key ordering: "is there an earlier unpublished row with my key?"
--   WHERE ordering_key = $key AND seq < $seq AND status <> 'PUBLISHED'
CREATE INDEX messaging_outbox_ordering_head_idx ON messaging_outbox (ordering_key, seq)
    WHERE ordering_key IS NOT NULL AND status <> 'PUBLISHED';

-- Serves operators' backlog questions (outboxctl status, redrive/purge plans):
--   WHERE status <> 'PUBLISHED' GROUP BY status, destination, tenant
CREATE INDEX messaging_outbox_backlog_idx ON messaging_outbox (status, destination, tenant, created_at)
    WHERE status <> 'PUBLISHED';

-- +goose Down
DROP TABLE messaging_outbox;
