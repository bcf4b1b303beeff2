-- +goose Up
-- Archive for retention's optional move mode: the same columns as the outbox
-- (routing_key and seq stored as plain values), for teams that must keep an
-- audit trail past the retention horizon.
CREATE TABLE messaging_outbox_archive (
    message_id          text        NOT NULL,
    destination         text        NOT NULL,
    payload             bytea       NOT NULL,
    headers             jsonb       NOT NULL,
    status              text        NOT NULL,
    seq                 bigint      NOT NULL,
    created_at          timestamptz NOT NULL,
    occurred_at         timestamptz,
    published_at        timestamptz,
    attempts            integer     NOT NULL,
    next_attempt_at     timestamptz,
    lease_owner         text,
    lease_token         bigint      NOT NULL,
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
    routing_key         text        NOT NULL,
    archived_at         timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT messaging_outbox_archive_pkey PRIMARY KEY (message_id)
);

-- Serves archive pruning and audits by time: WHERE archived_at < $cutoff
CREATE INDEX messaging_outbox_archive_archived_idx ON messaging_outbox_archive (archived_at);

-- +goose Down
DROP TABLE messaging_outbox_archive;
