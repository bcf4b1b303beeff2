-- +goose Up
-- Approvals recorded in the database (issue 21). An approval is written before
-- an operation runs, by the approver's own login: approved_by is session_user,
-- set by a trigger, never by the client. It binds the ticket to the plan
-- (operation and filter digest) and to the row set the approver saw: the
-- highest matching seq and the time of approval (only rows parked before it),
-- with the count approved as a ceiling. Grant INSERT on this table to an
-- approver role only, and the operators who execute cannot approve their own
-- plans (docs/SECURITY.md).
CREATE TABLE messaging_admin_approval (
    approval_ticket text        NOT NULL,
    operation       text        NOT NULL,
    plan_digest     text        NOT NULL,
    plan            jsonb       NOT NULL,
    max_seq         bigint      NOT NULL,
    parked_before   timestamptz NOT NULL,
    approved_count  bigint      NOT NULL,
    approved_by     text        NOT NULL DEFAULT session_user,
    approved_at     timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT messaging_admin_approval_pkey PRIMARY KEY (approval_ticket),
    CONSTRAINT messaging_admin_approval_count_check CHECK (approved_count >= 0)
);

-- +goose StatementBegin
CREATE FUNCTION messaging_admin_approval_who() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.approved_by := session_user;
    NEW.approved_at := now();
    RETURN NEW;
END $$;
-- +goose StatementEnd
CREATE TRIGGER messaging_admin_approval_who BEFORE INSERT OR UPDATE ON messaging_admin_approval
    FOR EACH ROW EXECUTE FUNCTION messaging_admin_approval_who();

-- Every login that began or took over an operation, in order, and those that
-- forced a takeover of a live lease: kept by a trigger (the client cannot
-- write them).
ALTER TABLE messaging_admin_operation
    ADD COLUMN executed_by text[] NOT NULL DEFAULT '{}',
    ADD COLUMN forced_by   text[] NOT NULL DEFAULT '{}';

-- +goose StatementBegin
CREATE FUNCTION messaging_admin_operation_who() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        NEW.executed_by := ARRAY[session_user::text];
        NEW.forced_by := '{}';
    ELSIF NEW.lease_token IS DISTINCT FROM OLD.lease_token THEN
        NEW.executed_by := OLD.executed_by || session_user::text;
        IF NEW.forced_by IS DISTINCT FROM OLD.forced_by THEN
            NEW.forced_by := OLD.forced_by || session_user::text;
        END IF;
    ELSE
        NEW.executed_by := OLD.executed_by;
        NEW.forced_by := OLD.forced_by;
    END IF;
    RETURN NEW;
END $$;
-- +goose StatementEnd
CREATE TRIGGER messaging_admin_operation_who BEFORE INSERT OR UPDATE ON messaging_admin_operation
    FOR EACH ROW EXECUTE FUNCTION messaging_admin_operation_who();

-- +goose Down
DROP TRIGGER messaging_admin_operation_who ON messaging_admin_operation;
DROP FUNCTION messaging_admin_operation_who();
ALTER TABLE messaging_admin_operation DROP COLUMN forced_by, DROP COLUMN executed_by;
DROP TRIGGER messaging_admin_approval_who ON messaging_admin_approval;
DROP FUNCTION messaging_admin_approval_who();
DROP TABLE messaging_admin_approval;
