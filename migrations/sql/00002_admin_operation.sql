-- +goose Up
-- The admin operation journal. The primary key (approval_ticket, plan_digest)
-- lets the database, not a check-then-act in Go, decide which replica runs an
-- approved destructive operation: exactly one INSERT wins.
CREATE TABLE messaging_admin_operation (
    approval_ticket  text        NOT NULL,
    plan_digest      text        NOT NULL,
    operation        text        NOT NULL,
    plan             jsonb       NOT NULL DEFAULT '{}'::jsonb,
    state            text        NOT NULL,
    owner            text        NOT NULL,
    lease_token      bigint      NOT NULL DEFAULT 1,
    lease_expires_at timestamptz NOT NULL,
    items_completed  bigint      NOT NULL DEFAULT 0,
    checkpoint       text,
    started_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    completed_at     timestamptz,
    failure_code     text,
    failure_detail   text,
    CONSTRAINT messaging_admin_operation_pkey PRIMARY KEY (approval_ticket, plan_digest),
    CONSTRAINT messaging_admin_operation_state_check CHECK (state IN ('STARTED', 'COMPLETED', 'FAILED')),
    CONSTRAINT messaging_admin_operation_items_check CHECK (items_completed >= 0)
);

-- +goose Down
DROP TABLE messaging_admin_operation;
