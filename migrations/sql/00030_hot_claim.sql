-- +goose Up
-- Make the claim a HOT update.
--
-- PostgreSQL updates a row in place (HOT: no new index entries, the heap
-- change logged as the few bytes that differ) only when the update changes no
-- column that any index reads, in its key, an expression or its WHERE
-- predicate, and the new version fits on the same page. Until now every index
-- predicate read status, so the claim (PENDING -> IN_FLIGHT) and every retry
-- wrote a full copy of the row plus one entry in each index: about as much WAL
-- as inserting the row again, twice per relayed message.
--
-- The same row sets are expressed with two columns that change only when a
-- row leaves the claimable set: published_at (set with PUBLISHED) and
-- parked_at (set with FAILED or EXHAUSTED). The two CHECKs below make the
-- equivalence a database rule rather than a convention, so an index predicate
-- on them can never disagree with status. Nothing indexed now changes on the
-- claim, on AMBIGUOUS, on a lease expiry or on a release; the terminal write
-- (published_at) and parking (parked_at) still add index entries, once per
-- row.

-- Rows written by earlier versions already satisfy both rules (every writer
-- sets published_at with PUBLISHED, parked_at with FAILED/EXHAUSTED, and
-- redrive clears parked_at); these statements only repair hand-edited rows so
-- the constraints can be added. Each is a sequential scan; on a large table
-- run this migration in a quiet period.
UPDATE messaging_outbox SET published_at = coalesce(last_attempt_at, created_at)
 WHERE status = 'PUBLISHED' AND published_at IS NULL;
UPDATE messaging_outbox SET published_at = NULL
 WHERE status <> 'PUBLISHED' AND published_at IS NOT NULL;
UPDATE messaging_outbox SET parked_at = coalesce(last_attempt_at, created_at)
 WHERE status IN ('FAILED', 'EXHAUSTED') AND parked_at IS NULL;
UPDATE messaging_outbox SET parked_at = NULL
 WHERE status NOT IN ('FAILED', 'EXHAUSTED') AND parked_at IS NOT NULL;

ALTER TABLE messaging_outbox
    ADD CONSTRAINT messaging_outbox_published_at_check
        CHECK ((status = 'PUBLISHED') = (published_at IS NOT NULL)),
    ADD CONSTRAINT messaging_outbox_parked_at_check
        CHECK ((status IN ('FAILED', 'EXHAUSTED')) = (parked_at IS NOT NULL));

-- Serves the claim: rows a relay may pick (PENDING, AMBIGUOUS, IN_FLIGHT), in
-- seq order
--   WHERE published_at IS NULL AND parked_at IS NULL ... ORDER BY seq LIMIT n FOR UPDATE SKIP LOCKED
DROP INDEX messaging_outbox_claimable_idx;
CREATE INDEX messaging_outbox_claimable_idx ON messaging_outbox (seq)
    WHERE published_at IS NULL AND parked_at IS NULL;

-- Serves retention: PUBLISHED rows older than the horizon, oldest first
--   WHERE published_at < $cutoff ORDER BY published_at LIMIT n
DROP INDEX messaging_outbox_published_idx;
CREATE INDEX messaging_outbox_published_idx ON messaging_outbox (published_at)
    WHERE published_at IS NOT NULL;

-- Serves per-key ordering: "is there an earlier unpublished row with my key?"
--   WHERE ordering_key = $key AND seq < $seq AND published_at IS NULL
DROP INDEX messaging_outbox_ordering_head_idx;
CREATE INDEX messaging_outbox_ordering_head_idx ON messaging_outbox (ordering_key, seq)
    WHERE ordering_key IS NOT NULL AND published_at IS NULL;

-- Serves redrive, purge and the status report's parked rows, in seq order
--   WHERE parked_at IS NOT NULL AND seq > $cursor ORDER BY seq LIMIT n
DROP INDEX messaging_outbox_parked_idx;
CREATE INDEX messaging_outbox_parked_idx ON messaging_outbox (seq)
    WHERE parked_at IS NOT NULL;

-- The operators' backlog index had status as its leading key, which alone
-- would keep every claim from being HOT, and it cost an entry on every insert.
-- The status queries now read the unpublished rows through the claimable and
-- parked indexes above (see status/EXPLAIN.md).
DROP INDEX messaging_outbox_backlog_idx;

-- The created_at index served only retention's ByCreatedAt mode (CDC) and
-- cost an entry on every insert and on every terminal write (measured: about
-- 7% of the insert's and 18% of the terminal write's server time). In CDC
-- mode every row stays in the claimable index, whose seq order is insertion
-- order, so ByCreatedAt now walks that index (and the parked and published
-- ones for the rest); see the retention package.
DROP INDEX messaging_outbox_created_at_idx;

-- Leave room on each page for the claim's new row versions, so that they
-- stay on their rows' page (the other condition for HOT). A claim takes
-- consecutive rows, i.e. every row of a page at once, so a page whose rows
-- should all be claimed HOT needs as much free space as they use
-- (fillfactor 50); at 70 about 40% of claims are HOT, at 100 none. Measured
-- with 1 KB payloads (cmd/outbox-bench -fillfactor 50/70/100, BENCHMARKS.md):
-- the relay drains about 10% faster per step down, 10-message insert
-- transactions cost about 5% more per step (more pages to extend), and the
-- table takes up to 1/0.7 or 1/0.5 times the pages. 70 is the balance that
-- keeps the write side within 10% of a bare INSERT; a relay-bound
-- deployment can choose 50, a disk-bound one 100: ALTER TABLE
-- messaging_outbox SET (fillfactor = ...) is safe at any time and applies to
-- pages written from then on.
ALTER TABLE messaging_outbox SET (fillfactor = 70);

-- +goose Down
ALTER TABLE messaging_outbox RESET (fillfactor);
CREATE INDEX messaging_outbox_created_at_idx ON messaging_outbox (created_at);
CREATE INDEX messaging_outbox_backlog_idx ON messaging_outbox (status, destination, tenant, created_at)
    WHERE status <> 'PUBLISHED';
DROP INDEX messaging_outbox_parked_idx;
CREATE INDEX messaging_outbox_parked_idx ON messaging_outbox (seq)
    WHERE status IN ('FAILED', 'EXHAUSTED');
DROP INDEX messaging_outbox_ordering_head_idx;
CREATE INDEX messaging_outbox_ordering_head_idx ON messaging_outbox (ordering_key, seq)
    WHERE ordering_key IS NOT NULL AND status <> 'PUBLISHED';
DROP INDEX messaging_outbox_published_idx;
CREATE INDEX messaging_outbox_published_idx ON messaging_outbox (published_at)
    WHERE status = 'PUBLISHED';
DROP INDEX messaging_outbox_claimable_idx;
CREATE INDEX messaging_outbox_claimable_idx ON messaging_outbox (seq)
    WHERE status IN ('PENDING', 'AMBIGUOUS', 'IN_FLIGHT');
ALTER TABLE messaging_outbox
    DROP CONSTRAINT messaging_outbox_parked_at_check,
    DROP CONSTRAINT messaging_outbox_published_at_check;
