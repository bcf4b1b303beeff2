package status

import "github.com/fencedoutbox/watermill-outbox/envelope"

// The SQL every status query runs, one constant per question. Each names the
// index that serves it; TestQueriesUseIndexes runs EXPLAIN on every one of
// them against a table holding enough rows for the planner to care, and
// EXPLAIN.md shows the plans.

// backlogQuery answers "how many unpublished rows, by status, destination and
// tenant, and how old is the oldest of each group". Served by the partial
// index messaging_outbox_backlog_idx (status, destination, tenant,
// created_at) WHERE status <> 'PUBLISHED': the predicate matches the index's,
// every column read is in the index, so the plan is an index-only scan that
// never visits the (much larger) published part of the table. $1 bounds the
// number of groups returned.
const backlogQuery = `
SELECT status, destination, coalesce(tenant, ''), count(*), min(created_at)
  FROM messaging_outbox
 WHERE status <> 'PUBLISHED'
 GROUP BY status, destination, tenant
 ORDER BY status, destination, tenant
 LIMIT $1`

// backlogByDestinationQuery is the collector's sample: the same index, with
// tenant left out so the metric labels stay bounded. The oldest pending age
// is computed by the database clock (or $2 when a caller pins "now"), so the
// age never mixes two clocks. $1 bounds the number of groups.
const backlogByDestinationQuery = `
SELECT status, destination, count(*),
       coalesce(extract(epoch FROM coalesce($2::timestamptz, now()) - min(created_at)), 0)::float8
  FROM messaging_outbox
 WHERE status <> 'PUBLISHED'
 GROUP BY status, destination
 ORDER BY status, destination
 LIMIT $1`

// failureCodesQuery answers "why are rows parked or in doubt": the most
// frequent last_failure_code per status among AMBIGUOUS, FAILED and
// EXHAUSTED rows. The status filter is served by messaging_outbox_backlog_idx
// (its leading column, inside its predicate); only the matching rows are
// fetched from the heap for last_failure_code. $1 bounds the result.
const failureCodesQuery = `
SELECT status, coalesce(last_failure_code, ''), count(*)
  FROM messaging_outbox
 WHERE status IN ('AMBIGUOUS', 'FAILED', 'EXHAUSTED')
 GROUP BY status, last_failure_code
 ORDER BY count(*) DESC, status, last_failure_code
 LIMIT $1`

// stuckCorrelationsQuery answers "which business flows are stuck": correlation
// ids with parked rows (FAILED, EXHAUSTED) or with rows still unpublished
// after the stuck threshold. "status <> 'PUBLISHED'" is written out so the
// planner can prove the partial predicate of messaging_outbox_backlog_idx;
// the status and created_at conditions are checked on the index entries, and
// only matching rows are fetched for correlation_id.
// $1 = now (NULL: the database clock), $2 = threshold in seconds, $3 = limit.
const stuckCorrelationsQuery = `
SELECT correlation_id,
       count(*) FILTER (WHERE status IN ('FAILED', 'EXHAUSTED')),
       count(*) FILTER (WHERE status NOT IN ('FAILED', 'EXHAUSTED')),
       min(created_at)
  FROM messaging_outbox
 WHERE status <> 'PUBLISHED'
   AND correlation_id IS NOT NULL
   AND (status IN ('FAILED', 'EXHAUSTED')
        OR created_at < coalesce($1::timestamptz, now()) - make_interval(secs => $2))
 GROUP BY correlation_id
 ORDER BY min(created_at), correlation_id
 LIMIT $3`

// messageQuery reads one row by its primary key (messaging_outbox_pkey).
const messageQuery = `SELECT ` + envelope.SelectColumns + ` FROM messaging_outbox WHERE message_id = $1`

// relaysQuery lists the polling relays whose heartbeat has not expired.
// messaging_relay_heartbeat holds one row per running relay (a handful), so
// a sequential scan of it is the right plan; it never touches the outbox.
const relaysQuery = `
SELECT owner, started_at, heartbeat_at, expires_at
  FROM messaging_relay_heartbeat
 WHERE expires_at > coalesce($1::timestamptz, now())
 ORDER BY owner`

// relayModeQuery reads the singleton relay-mode row. It is the same question
// debezium.CurrentMode answers, asked here inside the snapshot's transaction
// so the mode and the live relays are read at one instant.
const relayModeQuery = `SELECT mode, changed_at, changed_by FROM messaging_relay_mode WHERE id`

// dbNowQuery pins the snapshot's clock to the database's.
const dbNowQuery = `SELECT coalesce($1::timestamptz, now())`
