-- +goose Up
-- Serves retention in ByCreatedAt mode (CDC relay: a connector never marks rows
-- PUBLISHED, so age is the only signal):
--   WHERE created_at < $cutoff ORDER BY created_at LIMIT n FOR UPDATE SKIP LOCKED
-- Without it every bounded batch would scan the whole table to find the oldest
-- rows, and the batch bound would no longer bound the work.
-- Superseded: migration 00030 drops this index again (it cost an entry on
-- every insert and terminal write); ByCreatedAt now walks the claimable,
-- parked and published indexes instead (retention/batch.go).
CREATE INDEX messaging_outbox_created_at_idx ON messaging_outbox (created_at);

-- +goose Down
DROP INDEX messaging_outbox_created_at_idx;
