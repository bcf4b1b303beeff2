-- +goose Up
-- Room on every page for one new version of each of its rows, so that every
-- claim is a HOT update (00030 made the claim change no indexed column; the
-- other condition for HOT is room on the row's page). A claim takes
-- consecutive rows, i.e. every row of a page at once, so the page needs as
-- much free space as its rows use: fillfactor 50. At 70 (00030) only about
-- 40% of a claim's rows fit (fencing's TestClaimHOTShareFollowsFillfactor).
-- The terminal write gains too: once the claim has committed, the rows'
-- first versions are dead and can be pruned, leaving the PUBLISHED version
-- room on the same page, where its WAL record carries only the changed
-- bytes. No test pins that (pruning waits for every older snapshot to end);
-- the benchmark's drains show it in the WAL they write.
--
-- Measured with 1 KB payloads, side by side in one run (cmd/outbox-bench
-- -fillfactor 50 vs 70, BENCHMARKS.md): WAL per relayed row 533 vs 1,386
-- bytes at a 10k backlog; drain 1.15-1.2x faster at 10k-50k rows and 1.35x
-- at 1M (fewer checkpoints and backend writes); the publisher stays within
-- the write-side targets (0.96-1.22x a bare INSERT). The cost is disk: the
-- table takes about twice the pages of a full one (1.4x at 70). A
-- disk-bound deployment can set 70 or 100 back: ALTER TABLE
-- messaging_outbox SET (fillfactor = ...) takes a lock that does not block
-- reads or writes, is safe at any time and applies to pages written from
-- then on.
ALTER TABLE messaging_outbox SET (fillfactor = 50);

-- +goose Down
ALTER TABLE messaging_outbox SET (fillfactor = 70);
