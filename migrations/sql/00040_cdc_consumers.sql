-- +goose Up
-- CDC consumers announce themselves like polling relays do, so the database
-- can refuse a switch while the other kind of relay is alive. kind says which
-- kind of relay wrote the heartbeat; slot_name is the replication slot a CDC
-- consumer streams from (NULL for polling relays). Existing rows are polling
-- heartbeats: the only kind that beat before this migration.
ALTER TABLE messaging_relay_heartbeat
    ADD COLUMN kind      text NOT NULL DEFAULT 'POLLING',
    ADD COLUMN slot_name text,
    ADD CONSTRAINT messaging_relay_heartbeat_kind_check CHECK (kind IN ('POLLING', 'CDC')),
    ADD CONSTRAINT messaging_relay_heartbeat_slot_check CHECK ((kind = 'CDC') = (slot_name IS NOT NULL));

-- The Debezium connector's heartbeat.action.query inserts a row here every
-- heartbeat.interval.ms. The table is in the insert-only publication, so the
-- insert reaches the connector as a change and lets it confirm its position
-- while the outbox is idle: without it a quiet outbox in a busy database makes
-- the slot retain WAL without bound. The same statement deletes rows older
-- than an hour (deletes are not published), so the table stays small.
CREATE TABLE messaging_cdc_heartbeat (
    id        bigint      GENERATED ALWAYS AS IDENTITY,
    slot_name text        NOT NULL,
    beat_at   timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT messaging_cdc_heartbeat_pkey PRIMARY KEY (id)
);

-- One row per replication slot the native CDC relay created (cdcrelay), read
-- in the slot's own snapshot: before_seq is the highest seq of a row that was
-- committed before the slot and still undelivered (PENDING, IN_FLIGHT or
-- AMBIGUOUS) at that instant, NULL when there was none. Such rows are not in
-- the slot, so the relay refuses to stream while any row with seq <=
-- before_seq is still undelivered (CDC_UNDELIVERED_ROWS), and clears
-- before_seq once none is.
CREATE TABLE messaging_cdc_slot (
    slot_name      text        NOT NULL,
    consistent_lsn pg_lsn      NOT NULL,
    before_seq     bigint,
    created_at     timestamptz NOT NULL DEFAULT now(),
    created_mode   text        NOT NULL,
    CONSTRAINT messaging_cdc_slot_pkey PRIMARY KEY (slot_name)
);

-- +goose Down
DROP TABLE messaging_cdc_slot;
DROP TABLE messaging_cdc_heartbeat;
DELETE FROM messaging_relay_heartbeat WHERE kind <> 'POLLING';
ALTER TABLE messaging_relay_heartbeat
    DROP CONSTRAINT messaging_relay_heartbeat_slot_check,
    DROP CONSTRAINT messaging_relay_heartbeat_kind_check,
    DROP COLUMN slot_name,
    DROP COLUMN kind;
