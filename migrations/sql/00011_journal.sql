-- +goose Up
-- One approval ticket binds exactly one plan: the primary key alone
-- (approval_ticket, plan_digest) would let the same ticket run a second,
-- different plan. With this index the INSERT that begins an operation conflicts
-- on the ticket too, and the journal refuses the other digest
-- (JOURNAL_PLAN_MISMATCH) instead of a check-then-act in Go.
CREATE UNIQUE INDEX messaging_admin_operation_ticket_key ON messaging_admin_operation (approval_ticket);

-- Serves redrive and purge: parked rows walked in seq order (keyset)
--   WHERE status IN ('FAILED','EXHAUSTED') AND seq > $cursor ORDER BY seq LIMIT n
-- Parked rows are few, so this partial index stays small.
CREATE INDEX messaging_outbox_parked_idx ON messaging_outbox (seq)
    WHERE status IN ('FAILED', 'EXHAUSTED');

-- +goose Down
DROP INDEX messaging_outbox_parked_idx;
DROP INDEX messaging_admin_operation_ticket_key;
