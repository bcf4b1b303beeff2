-- +goose Up
-- The CDC relay's record timestamp. Debezium's outbox event router reads
-- table.field.event.timestamp with Struct.getInt64 and accepts only the
-- Timestamp, MicroTimestamp and NanoTimestamp logical types, i.e. a column
-- WITHOUT time zone. The PostgreSQL connector maps timestamptz (created_at)
-- to io.debezium.time.ZonedTimestamp, a string, so pointing the router at
-- created_at would fail every record. This column is created_at in UTC as a
-- plain timestamp (MicroTimestamp on the wire), derived by the database so it
-- can never disagree with created_at. timezone(text, timestamptz) is
-- IMMUTABLE, which a stored generated column requires.
ALTER TABLE messaging_outbox
    ADD COLUMN created_at_utc timestamp GENERATED ALWAYS AS (created_at AT TIME ZONE 'UTC') STORED;

-- +goose Down
ALTER TABLE messaging_outbox DROP COLUMN created_at_utc;
