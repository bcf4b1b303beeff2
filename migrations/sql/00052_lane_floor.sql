-- +goose Up
-- Lane floors: where a lane's claims start looking for unkeyed rows.
--
-- A lane claim finds a lane's next unkeyed run by descending
-- messaging_outbox_lane_idx from a start seq. The index keeps the entries
-- of every row published or parked since the oldest snapshot still open
-- (no scan may mark them dead while it is held), so a descent from seq 0
-- steps over all of them: with a REPEATABLE READ snapshot held across six
-- rounds of 20,000 rows, 50-470 ms per claim that starts there (39,000
-- buffers for 32 lane descents). floor_seq persists, per lane, a seq below
-- which no claimable unkeyed row of the lane can appear any more, and the
-- claims descend from greatest(start, floor_seq): a new relay, a new owner
-- of the lane and a relay's rescans skip the dead prefix.
--
-- The floor is raised only by fencing.AdvanceLaneFloors, in two steps:
-- a candidate (floor_cand_seq: the lane's first unkeyed row neither
-- published nor parked at or above the floor, else the identity's last
-- value + 1, taken at floor_cand_at) recorded with the transactions then
-- in progress that could still commit a row below it (floor_cand_wait:
-- 'pid/xact_start in microseconds since the epoch' of each), and, at a
-- later call, the raise to it once none of them is still running (see
-- fencing/floor.go for the argument), after a recheck with a snapshot
-- taken after that test.
-- Anything that makes a parked row claimable again lowers the floor in
-- the same transaction (journal's redrive); fencing.SetLaneCount replaces
-- the lane rows, so every floor starts again at 0. The per-row fence
-- (ROWS) ignores the floors.
ALTER TABLE messaging_relay_lane
    ADD COLUMN floor_seq      bigint NOT NULL DEFAULT 0,
    ADD COLUMN floor_cand_seq bigint,
    ADD COLUMN floor_cand_at  timestamptz,
    ADD COLUMN floor_cand_wait text[];

-- A redrive lowers the floors through this function, not by updating
-- messaging_relay_lane itself: the operator who redrives (outboxctl, the
-- console) is granted the outbox and the journal, not the lanes
-- (docs/SECURITY.md), and needs no more than EXECUTE here. It runs as the
-- migration's owner, on the search path of the migration (FROM CURRENT:
-- the schema the outbox lives in). It lowers every lane's floor to
-- below (NULL: nothing) and drops their candidates, locking the lanes in
-- lane order as the relays lock them (fencing/floor.go); least() reads the
-- lane row's newest version, so a raise that commits first is lowered
-- again.
-- +goose StatementBegin
CREATE FUNCTION messaging_lower_lane_floors(below bigint) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    n integer;
BEGIN
    IF below IS NULL THEN
        RETURN 0;
    END IF;
    PERFORM 1 FROM messaging_relay_lane ORDER BY lane FOR NO KEY UPDATE;
    UPDATE messaging_relay_lane
       SET floor_seq = least(floor_seq, below),
           floor_cand_seq = NULL, floor_cand_at = NULL, floor_cand_wait = NULL;
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END $$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION messaging_lower_lane_floors(bigint);
ALTER TABLE messaging_relay_lane
    DROP COLUMN floor_cand_wait,
    DROP COLUMN floor_cand_at,
    DROP COLUMN floor_cand_seq,
    DROP COLUMN floor_seq;
