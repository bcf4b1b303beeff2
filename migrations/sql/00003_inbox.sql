-- +goose Up
-- Consumer-side de-duplication: one row per (consumer, message id), written in
-- the consumer's own transaction together with the effect of the message.
CREATE TABLE messaging_inbox (
    consumer     text        NOT NULL,
    message_id   text        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT messaging_inbox_pkey PRIMARY KEY (consumer, message_id)
);

-- Serves inbox retention: WHERE processed_at < $cutoff ORDER BY processed_at LIMIT n
CREATE INDEX messaging_inbox_processed_idx ON messaging_inbox (processed_at);

-- +goose Down
DROP TABLE messaging_inbox;
