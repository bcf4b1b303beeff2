-- +goose Up
-- Each relay's attempt budget (forwarder.Config.MaxAttempts), written with its
-- heartbeat. The budget is not in the outbox row: each relay's own
-- configuration decides when a row is EXHAUSTED, so a replica with a lower
-- budget parks the rows of the others; outboxctl status lists the live
-- relays' budgets and warns when they differ. NULL: a relay that did not say.
ALTER TABLE messaging_relay_heartbeat ADD COLUMN max_attempts integer;

-- +goose Down
ALTER TABLE messaging_relay_heartbeat DROP COLUMN max_attempts;
