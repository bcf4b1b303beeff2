-- +goose Up
-- The open breakers of the polling relays (forwarder: a destination whose
-- downstream is unavailable as a whole; its rows wait without spending
-- attempts while the relay probes it), for operators: a row is written when a
-- breaker opens and deleted when it closes and when the relay stops.
-- outboxctl status shows the rows of relays whose heartbeat is live; a row
-- left by a relay that died is ignored until the same owner starts again.
CREATE TABLE messaging_relay_breaker (
    owner       text        NOT NULL,
    destination text        NOT NULL,
    opened_at   timestamptz NOT NULL DEFAULT now(),
    last_error  text,
    CONSTRAINT messaging_relay_breaker_pkey PRIMARY KEY (owner, destination)
);

-- +goose Down
DROP TABLE messaging_relay_breaker;
