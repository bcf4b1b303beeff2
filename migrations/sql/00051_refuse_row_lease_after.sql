-- +goose Up
-- The trigger refusing per-row leases while the fleet runs on lanes
-- (00050) fires AFTER the row is written instead of BEFORE. A BEFORE ROW
-- trigger makes PostgreSQL lock the old row version before the update
-- (whatever its WHEN clause says), and that lock is a WAL record of its
-- own. Every update of messaging_outbox paid it, so a lane outcome, the
-- row's only write, cost two heap records instead of one (pg_walinspect on
-- a drain of 20,000 1 KB rows: one Heap/LOCK per row; the lanes' WAL per
-- message without full-page images fell from 404 to 319 bytes).
-- An AFTER ROW trigger takes no lock, and its WHEN clause decides whether
-- the row is queued at all, so an outcome costs nothing here. A relay
-- built before lanes is refused as before: its claim statement fails with
-- FENCE_SCHEME_CONFLICT and writes nothing. CREATE OR REPLACE (PostgreSQL
-- 14+) takes the lock CREATE TRIGGER takes (SHARE ROW EXCLUSIVE: writes
-- wait, reads do not); DROP TRIGGER would take ACCESS EXCLUSIVE.
CREATE OR REPLACE TRIGGER messaging_outbox_refuse_row_lease
    AFTER UPDATE ON messaging_outbox FOR EACH ROW
    WHEN (NEW.status = 'IN_FLIGHT' AND OLD.status IS DISTINCT FROM 'IN_FLIGHT')
    EXECUTE FUNCTION messaging_outbox_refuse_row_lease();

-- +goose Down
CREATE OR REPLACE TRIGGER messaging_outbox_refuse_row_lease
    BEFORE UPDATE ON messaging_outbox FOR EACH ROW
    WHEN (NEW.status = 'IN_FLIGHT' AND OLD.status IS DISTINCT FROM 'IN_FLIGHT')
    EXECUTE FUNCTION messaging_outbox_refuse_row_lease();
