-- +goose Up
-- Which relay publishes the outbox: the polling forwarder or a CDC connector.
-- Exactly one row (id = true); the database, not documentation, is the record.
CREATE TABLE messaging_relay_mode (
    id         boolean     NOT NULL DEFAULT true,
    mode       text        NOT NULL DEFAULT 'POLLING',
    changed_at timestamptz NOT NULL DEFAULT now(),
    changed_by text        NOT NULL DEFAULT 'migration',
    CONSTRAINT messaging_relay_mode_pkey PRIMARY KEY (id),
    CONSTRAINT messaging_relay_mode_singleton CHECK (id),
    CONSTRAINT messaging_relay_mode_check CHECK (mode IN ('POLLING', 'CDC'))
);
INSERT INTO messaging_relay_mode (id, mode) VALUES (true, 'POLLING');

-- Live polling relays announce themselves here; a CDC switch refuses while
-- any heartbeat is fresh.
CREATE TABLE messaging_relay_heartbeat (
    owner        text        NOT NULL,
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now(),
    expires_at   timestamptz NOT NULL,
    CONSTRAINT messaging_relay_heartbeat_pkey PRIMARY KEY (owner)
);

-- +goose Down
DROP TABLE messaging_relay_heartbeat;
DROP TABLE messaging_relay_mode;
