-- +goose Up
-- An empty ordering key means no key: the publisher never writes one (it
-- stores an absent key as NULL), and the relay reads NULL and '' alike, so a
-- row written by SQL with ordering_key = '' would be walked as a key by the
-- claim and published as unkeyed by the relay, out of order. Existing ''
-- keys become NULL, and the table refuses new ones (SQLSTATE 23514). The
-- constraint is added NOT VALID and validated separately, so validation
-- does not block writers.
UPDATE messaging_outbox SET ordering_key = NULL WHERE ordering_key = '';
ALTER TABLE messaging_outbox ADD CONSTRAINT messaging_outbox_ordering_key_check
    CHECK (ordering_key <> '') NOT VALID;
ALTER TABLE messaging_outbox VALIDATE CONSTRAINT messaging_outbox_ordering_key_check;

-- +goose Down
ALTER TABLE messaging_outbox DROP CONSTRAINT messaging_outbox_ordering_key_check;
