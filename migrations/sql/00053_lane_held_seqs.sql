-- +goose Up
-- A lane's held record lists the seqs of the rows its owner holds in
-- flight, not their message ids.
--
-- Every lane claim rewrites the record of each lane it reads (what the
-- owner still holds there and the new rows), and tests every row it reads
-- against what the owner holds. With message ids (36-byte UUID text in
-- most services) a lane's array grew past PostgreSQL's inline limit and
-- was written out of line at every claim, and each comparison hashed a
-- string. With seqs (8 bytes, fixed width, unique: the column is GENERATED
-- ALWAYS AS IDENTITY) a claim of 1,000 rows of 1 KB holding 2,000 costs the
-- server 5.1-5.3 µs per row against 7.2-7.6 (BenchmarkLaneClaimHoldingRows,
-- BENCHMARKS.md). A takeover finds the rows it charges by seq, through
-- messaging_outbox_claimable_idx (an entry per row neither published nor
-- parked: exactly the rows it may charge).
--
-- The lane scheme had not been released when this changed: no relay of a
-- released version writes held_ids. What a relay of an unreleased build
-- held there when this runs is dropped with the column, as a give-back
-- drops it (not charged).
ALTER TABLE messaging_relay_lane_held
    DROP CONSTRAINT messaging_relay_lane_held_check,
    DROP COLUMN held_ids,
    ADD COLUMN held_seqs bigint[] NOT NULL DEFAULT '{}';
UPDATE messaging_relay_lane_held SET held_attempts = '{}' WHERE cardinality(held_attempts) > 0;
ALTER TABLE messaging_relay_lane_held
    ADD CONSTRAINT messaging_relay_lane_held_check CHECK (cardinality(held_seqs) = cardinality(held_attempts));

-- +goose Down
ALTER TABLE messaging_relay_lane_held
    DROP CONSTRAINT messaging_relay_lane_held_check,
    DROP COLUMN held_seqs,
    ADD COLUMN held_ids text[] NOT NULL DEFAULT '{}';
UPDATE messaging_relay_lane_held SET held_attempts = '{}' WHERE cardinality(held_attempts) > 0;
ALTER TABLE messaging_relay_lane_held
    ADD CONSTRAINT messaging_relay_lane_held_check CHECK (cardinality(held_ids) = cardinality(held_attempts));
