package status

import "github.com/fencedoutbox/watermill-outbox/envelope"

// The SQL every status query runs, one constant per question. Each names the
// index that serves it; TestQueriesUseIndexes runs EXPLAIN on every one of
// them against a table holding enough rows for the planner to care, and
// EXPLAIN.md shows the plans.

// unpublished is the set of rows not yet PUBLISHED, written as the union of
// the predicates of the two partial indexes that hold it:
// messaging_outbox_claimable_idx (published_at IS NULL AND parked_at IS NULL:
// PENDING, AMBIGUOUS, IN_FLIGHT) and messaging_outbox_parked_idx (parked_at IS
// NOT NULL: FAILED, EXHAUSTED). The table's CHECKs tie both columns to status,
// so this is exactly "status <> 'PUBLISHED'"; spelled this way the planner can
// answer it with a BitmapOr of the two indexes and never visits the (much
// larger) published part of the table. There is no index with status as a
// key: status changes on every claim, and an index reading it would keep the
// claim from being a HOT update (migration 00030).
const unpublished = `((published_at IS NULL AND parked_at IS NULL) OR parked_at IS NOT NULL)`

// backlogQuery answers "how many unpublished rows, by status, destination and
// tenant, and how old is the oldest of each group". $1 bounds the number of
// groups returned.
const backlogQuery = `
SELECT status, destination, coalesce(tenant, ''), count(*), min(created_at)
  FROM messaging_outbox
 WHERE ` + unpublished + `
 GROUP BY status, destination, tenant
 ORDER BY status, destination, tenant
 LIMIT $1`

// backlogByDestinationQuery is the collector's sample: the same rows, with
// tenant left out so the metric labels stay bounded. It returns one total
// per status first (destination NULL; at most five), then the (status,
// destination) groups largest first, so the LIMIT ($1 groups plus the
// totals) can only cut small groups: the per-status counts and ages stay
// exact and the cut part is summed under _other by the collector. The oldest
// pending age is computed by the database clock (or $2 when a caller pins
// "now"), so the age never mixes two clocks.
const backlogByDestinationQuery = `
SELECT status, destination, count(*),
       coalesce(extract(epoch FROM coalesce($2::timestamptz, now()) - min(created_at)), 0)::float8
  FROM messaging_outbox
 WHERE ` + unpublished + `
 GROUP BY GROUPING SETS ((status), (status, destination))
 ORDER BY GROUPING(destination) DESC, count(*) DESC, status, destination
 LIMIT $1 + 5`

// failureCodesQuery answers "why are rows parked or in doubt": the most
// frequent last_failure_code per status among AMBIGUOUS, FAILED and
// EXHAUSTED rows, read from the unpublished rows only. $1 bounds the result.
const failureCodesQuery = `
SELECT status, coalesce(last_failure_code, ''), count(*)
  FROM messaging_outbox
 WHERE ` + unpublished + `
   AND status IN ('AMBIGUOUS', 'FAILED', 'EXHAUSTED')
 GROUP BY status, last_failure_code
 ORDER BY count(*) DESC, status, last_failure_code
 LIMIT $1`

// stuckCorrelationsQuery answers "which business flows are stuck": correlation
// ids with parked rows (FAILED, EXHAUSTED) or with rows still unpublished
// after the stuck threshold. Each arm of the OR is the predicate of one
// partial index (parked, claimable), so the plan is a BitmapOr of the two.
// $1 = now (NULL: the database clock), $2 = threshold in seconds, $3 = limit.
// The last column counts every stuck correlation id before the LIMIT, so a
// cut list can say how many more there are.
const stuckCorrelationsQuery = `
SELECT correlation_id,
       count(*) FILTER (WHERE parked_at IS NOT NULL),
       count(*) FILTER (WHERE parked_at IS NULL),
       min(created_at),
       count(*) OVER ()
  FROM messaging_outbox
 WHERE correlation_id IS NOT NULL
   AND (parked_at IS NOT NULL
        OR (published_at IS NULL AND parked_at IS NULL
            AND created_at < coalesce($1::timestamptz, now()) - make_interval(secs => $2)))
 GROUP BY correlation_id
 ORDER BY min(created_at), correlation_id
 LIMIT $3`

// messageQuery reads one row by its primary key (messaging_outbox_pkey).
const messageQuery = `SELECT ` + envelope.SelectColumns + ` FROM messaging_outbox WHERE message_id = $1`

// dbNowQuery pins the snapshot's clock to the database's.
const dbNowQuery = `SELECT coalesce($1::timestamptz, now())`

// slotsQuery reads the logical replication slots of the current database
// (pg_replication_slots: a catalog view, no outbox table). Lags are measured
// against the server's WAL position (the last replayed one on a standby).
const slotsQuery = `
SELECT slot_name, coalesce(plugin, ''), active, coalesce(wal_status, ''),
       coalesce(pg_wal_lsn_diff(w.lsn, restart_lsn), 0)::int8,
       coalesce(pg_wal_lsn_diff(w.lsn, confirmed_flush_lsn), 0)::int8,
       safe_wal_size
  FROM pg_replication_slots,
       (SELECT CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_lsn() END AS lsn) w
 WHERE slot_type = 'logical' AND database = current_database()
 ORDER BY slot_name`

// undeliveredBeforeSlotQuery answers "may the CDC relay start on this slot":
// for each slot the native relay created (messaging_cdc_slot, migration
// 00040), how many undelivered rows were committed before the slot (seq up
// to its before_seq; 0 once the boundary is closed). Served by the claimable
// index (its predicate, a range on seq).
const undeliveredBeforeSlotQuery = `
SELECT b.slot_name,
       (SELECT count(*) FROM messaging_outbox o
         WHERE o.published_at IS NULL AND o.parked_at IS NULL AND o.seq <= b.before_seq)
  FROM messaging_cdc_slot b
 ORDER BY b.slot_name`
