-- +goose Up
-- Lanes: the fence moves from the row to the lane the row belongs to.
--
-- Every row belongs to one of N lanes (here N = 32), derived from its
-- ordering key, or from its seq when it has none (runs of 32 consecutive
-- rows, which share heap pages):
--
--     CASE WHEN ordering_key IS NULL THEN (seq >> 5) % N
--          ELSE (hashtext(ordering_key) & 2147483647) % N END
--
-- A key lives in one lane, so it is in the hands of one relay at a time. A
-- relay owns a fair share of the lanes (owner, epoch, lease below), reads
-- its lanes' claimable rows without writing them, and writes each row once:
-- its outcome, committed only while the lane's owner and epoch are still
-- the relay's (the outcome statement holds the lane row FOR SHARE; a
-- takeover's UPDATE of the lane waits for it). With lanes a relayed
-- message costs one row version instead of two (the per-row lease, then the
-- outcome), and relays never step over each other's locked rows.
--
-- The row's lease columns are then written only by the outcome: lease_owner
-- is the relay that wrote it and lease_token the lane's epoch at that time;
-- lease_expires_at stays NULL. status IN_FLIGHT is written by relays of the
-- per-row scheme only (fencing.Claim); a lane relay's in-flight rows are
-- the held_ids of messaging_relay_lane_held, shown by outboxctl status.
--
-- N is a constant in the lanes' index expression and in the statements the
-- relays run (fencing reads it from this table's row count). It is set with
-- fencing.SetLaneCount (outboxctl lanes set N), which refuses while a lane
-- is owned and (re)builds the index; see docs/FENCE.md.
CREATE TABLE messaging_relay_lane (
    lane             integer     NOT NULL,
    owner            text,
    -- Bumped at every change of owner (a takeover, a give-back, a first
    -- take): the generation a stale owner is fenced by.
    epoch            bigint      NOT NULL DEFAULT 0,
    lease_expires_at timestamptz,
    changed_at       timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT messaging_relay_lane_pkey PRIMARY KEY (lane),
    CONSTRAINT messaging_relay_lane_lane_check CHECK (lane >= 0 AND lane < 4096),
    CONSTRAINT messaging_relay_lane_owner_check CHECK ((owner IS NULL) = (lease_expires_at IS NULL))
) WITH (fillfactor = 50);
INSERT INTO messaging_relay_lane (lane) SELECT g FROM generate_series(0, 31) g;

-- What each lane's owner holds in flight (written once per claimed batch,
-- before it publishes): the message ids and the attempts each had when
-- read, under the lane's epoch. The next owner charges an attempt to every
-- row still listed with the same attempts (no outcome was written for it),
-- so a message that kills its relay mid-publish still ends EXHAUSTED after
-- its budget. A table of its own so that a claim's record does not lock
-- the lane row, which the owner's outcome writes hold FOR SHARE.
CREATE TABLE messaging_relay_lane_held (
    lane          integer   NOT NULL,
    epoch         bigint    NOT NULL DEFAULT 0,
    held_ids      text[]    NOT NULL DEFAULT '{}',
    held_attempts integer[] NOT NULL DEFAULT '{}',
    CONSTRAINT messaging_relay_lane_held_pkey PRIMARY KEY (lane),
    CONSTRAINT messaging_relay_lane_held_lane_fkey FOREIGN KEY (lane) REFERENCES messaging_relay_lane (lane) ON DELETE CASCADE,
    CONSTRAINT messaging_relay_lane_held_check CHECK (cardinality(held_ids) = cardinality(held_attempts))
) WITH (fillfactor = 50);
INSERT INTO messaging_relay_lane_held (lane) SELECT lane FROM messaging_relay_lane;

-- The lanes' index, messaging_outbox_lane_idx, is not built here: it costs
-- every unkeyed insert an index entry, and a fleet on per-row leases (the
-- default) never reads it. fencing.SetLaneCount (outboxctl lanes set N)
-- builds it when a database moves to lanes; a lane relay refuses to start
-- without it (LANES_MISSING). It serves a lane's unkeyed claimable rows in
-- seq order:
--   WHERE (seq >> 5) % N = $lane
--     AND ordering_key IS NULL AND published_at IS NULL AND parked_at IS NULL
--     AND seq >= $from ORDER BY seq LIMIT n
-- (keyed rows are found through messaging_outbox_ordering_head_idx, key by
-- key).

-- Which fence the fleet runs: ROWS (per-row leases, status IN_FLIGHT) or
-- LANES. A relay of either scheme refuses to start while a live relay of the
-- other runs (FENCE_SCHEME_CONFLICT), and the first one to start records its
-- scheme here.
ALTER TABLE messaging_relay_mode ADD COLUMN fence text NOT NULL DEFAULT 'ROWS'
    CONSTRAINT messaging_relay_mode_fence_check CHECK (fence IN ('ROWS', 'LANES'));
-- Each polling relay's scheme, written by lane relays with their lane
-- renewals (NULL: a relay of the per-row scheme, including every relay built
-- before lanes).
ALTER TABLE messaging_relay_heartbeat ADD COLUMN fence text;

-- A relay built before lanes knows nothing of the two columns above: the
-- database refuses its claims (a row entering IN_FLIGHT) while the fleet
-- runs on lanes, so an old binary started by mistake publishes nothing
-- instead of racing the lane owners. Only a row entering IN_FLIGHT runs the
-- function; lane relays never write that status.
-- +goose StatementBegin
CREATE FUNCTION messaging_outbox_refuse_row_lease() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM messaging_relay_mode WHERE id AND fence = 'LANES') THEN
        RAISE EXCEPTION 'FENCE_SCHEME_CONFLICT: the relays of this database run on lanes; a per-row lease (status IN_FLIGHT) is refused'
            USING ERRCODE = 'P0001', HINT = 'stop this relay, or stop every lane relay and use the per-row scheme (fence ROWS)';
    END IF;
    RETURN NEW;
END
$$;
-- +goose StatementEnd
CREATE TRIGGER messaging_outbox_refuse_row_lease
    BEFORE UPDATE ON messaging_outbox FOR EACH ROW
    WHEN (NEW.status = 'IN_FLIGHT' AND OLD.status IS DISTINCT FROM 'IN_FLIGHT')
    EXECUTE FUNCTION messaging_outbox_refuse_row_lease();

-- +goose Down
DROP TRIGGER messaging_outbox_refuse_row_lease ON messaging_outbox;
DROP FUNCTION messaging_outbox_refuse_row_lease();
ALTER TABLE messaging_relay_heartbeat DROP COLUMN fence;
ALTER TABLE messaging_relay_mode DROP COLUMN fence;
DROP INDEX IF EXISTS messaging_outbox_lane_idx;
DROP TABLE messaging_relay_lane_held;
DROP TABLE messaging_relay_lane;
