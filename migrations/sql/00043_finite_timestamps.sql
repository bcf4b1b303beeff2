-- +goose Up
-- The relay cannot represent 'infinity' or '-infinity' in a Go time.Time,
-- and neither can a consumer in msg.occurred_at: such a row written by SQL
-- is parked per row (OUTBOX_CORRUPT_ROW), never delivered. The table now
-- refuses them (SQLSTATE 23514) in the timestamps the relay reads or
-- reports: created_at, occurred_at, published_at and parked_at. One CHECK,
-- so a write pays one expression per row.
--
-- Existing rows are not rewritten: a value the application wrote is not
-- ours to invent a replacement for. The constraint is added NOT VALID (new
-- and updated rows are checked at once, without a table scan under an
-- exclusive lock) and then validated only when no existing row breaks it,
-- which takes a SHARE UPDATE EXCLUSIVE lock that does not block writers.
-- When some row does, the migration still succeeds: the constraint stays
-- NOT VALID, the relay keeps parking those rows as OUTBOX_CORRUPT_ROW, and
-- an operator validates it after fixing or purging them
-- (docs/BAD_INPUT.md shows the statements).
ALTER TABLE messaging_outbox ADD CONSTRAINT messaging_outbox_finite_timestamps_check
    CHECK (isfinite(created_at) AND isfinite(occurred_at) AND isfinite(published_at) AND isfinite(parked_at)) NOT VALID;
-- +goose StatementBegin
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM messaging_outbox
                    WHERE NOT (isfinite(created_at) AND isfinite(occurred_at) AND isfinite(published_at) AND isfinite(parked_at))) THEN
        ALTER TABLE messaging_outbox VALIDATE CONSTRAINT messaging_outbox_finite_timestamps_check;
    END IF;
END
$$;
-- +goose StatementEnd

-- +goose Down
ALTER TABLE messaging_outbox DROP CONSTRAINT messaging_outbox_finite_timestamps_check;
