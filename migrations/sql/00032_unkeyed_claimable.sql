-- +goose Up
-- Serves the claim's unkeyed half: rows without an ordering key that a relay
-- may pick, in seq order
--   WHERE ordering_key IS NULL AND published_at IS NULL AND parked_at IS NULL
--     AND seq >= $from ORDER BY seq LIMIT n FOR UPDATE SKIP LOCKED
-- Keyed rows are found through their key's head in
-- messaging_outbox_ordering_head_idx instead (fencing.Claim walks the keys,
-- not the rows), so this index holds none of them: a backlog of one hot key
-- costs the unkeyed scan nothing. The claim leaves every indexed column
-- alone, so it stays a HOT update with this index too.
CREATE INDEX messaging_outbox_unkeyed_claimable_idx ON messaging_outbox (seq)
    WHERE ordering_key IS NULL AND published_at IS NULL AND parked_at IS NULL;

-- +goose Down
DROP INDEX messaging_outbox_unkeyed_claimable_idx;
