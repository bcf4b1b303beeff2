package console

// The SQL the console runs itself, one constant per question. The overview
// and the relays page also read status.CollectWith (its queries are
// explained in status/EXPLAIN.md and checked by status's
// TestQueriesUseIndexes), the inspector status.Message (primary key), and
// plans count through the journal (messaging_outbox_parked_idx).
// TestPageQueriesUseIndexes runs EXPLAIN on each constant here against a
// table large enough for the planner to care and refuses a Seq Scan on
// messaging_outbox.

// deliveredPerMinuteQuery: rows published per minute since $1, from
// published_at through messaging_outbox_published_idx (published_at WHERE
// published_at IS NOT NULL; a table CHECK sets published_at exactly on
// PUBLISHED rows). The history is the table itself, so it survives a
// console restart; retention deleting rows younger than the chart's hour
// would thin it (retention's horizon is hours or days).
const deliveredPerMinuteQuery = `
SELECT date_trunc('minute', published_at), count(*)
  FROM messaging_outbox
 WHERE published_at IS NOT NULL AND published_at >= $1
 GROUP BY 1
 ORDER BY 1`

// parkedPerMinuteQuery: rows parked per minute since $1 that are still
// parked (a redriven or purged row leaves the chart: parked_at is cleared),
// read through messaging_outbox_parked_idx (seq WHERE parked_at IS NOT
// NULL; a table CHECK sets parked_at exactly on FAILED and EXHAUSTED rows):
// the parked rows are few, and no index has parked_at as a key.
const parkedPerMinuteQuery = `
SELECT date_trunc('minute', parked_at), count(*)
  FROM messaging_outbox
 WHERE parked_at IS NOT NULL AND parked_at >= $1
 GROUP BY 1
 ORDER BY 1`

// parkedWhere is journal's filter over the parked rows, the same
// parameters in the same places ($1 statuses, $2 destination, $3 tenant, $4
// failure code, $5 created at or after, $6 created before; NULL does not
// filter), so the list pages through exactly the rows a plan of this filter
// counts. "parked_at IS NOT NULL" is the predicate of
// messaging_outbox_parked_idx.
const parkedWhere = `
       parked_at IS NOT NULL AND status = ANY($1::text[])
   AND ($2::text IS NULL OR destination = $2)
   AND ($3::text IS NULL OR tenant = $3)
   AND ($4::text IS NULL OR last_failure_code = $4)
   AND ($5::timestamptz IS NULL OR created_at >= $5)
   AND ($6::timestamptz IS NULL OR created_at < $6)`

// parkedPageQuery: one page of the parked rows matching the filter, in seq
// order after the keyset cursor $7 (0 = first page), $8 rows; a walk of
// messaging_outbox_parked_idx from the cursor.
const parkedPageQuery = `
SELECT message_id, seq, status, destination, coalesce(tenant, ''), coalesce(last_failure_code, ''),
       attempts, created_at, parked_at, octet_length(payload)
  FROM messaging_outbox
 WHERE` + parkedWhere + `
   AND seq > $7
 ORDER BY seq
 LIMIT $8`

// heldOffQuery: rows waiting (PENDING, AMBIGUOUS, IN_FLIGHT) per destination
// among the destinations $1 with an open breaker: what each breaker holds
// off, counted up to $2 rows in all (a destination whose relay is down can
// hold most of a large backlog; the page then says "at least"). Served by
// messaging_outbox_claimable_idx (its predicate); no index has destination
// as a key, so with a breaker open it walks the waiting rows until it has
// found $2 of the destinations' rows.
const heldOffQuery = `
SELECT destination, count(*)
  FROM (SELECT destination FROM messaging_outbox
         WHERE published_at IS NULL AND parked_at IS NULL AND destination = ANY($1::text[])
         LIMIT $2) w
 GROUP BY destination`

// heldOffLimit bounds the rows heldOffQuery counts.
const heldOffLimit = 10000

// laneTableQuery: whether this schema has the relay lanes (migration
// 00050), and which fence the fleet runs (ROWS or LANES).
const laneTableQuery = `
SELECT to_regclass('messaging_relay_lane') IS NOT NULL,
       coalesce((SELECT to_jsonb(m) ->> 'fence' FROM messaging_relay_mode m WHERE id), '')`

// lanesQuery: every lane (a few dozen rows) with its owner, epoch, lease
// and how many rows its owner holds in flight.
const lanesQuery = `
SELECT l.lane, coalesce(l.owner, ''), l.epoch, l.lease_expires_at, coalesce(cardinality(d.held_seqs), 0)
  FROM messaging_relay_lane l
  LEFT JOIN messaging_relay_lane_held d ON d.lane = l.lane AND d.epoch = l.epoch
 ORDER BY l.lane`

// approvalsQuery: the most recent approvals (messaging_admin_approval, one
// row per ticket: a small table).
const approvalsQuery = `
SELECT approval_ticket, operation, plan_digest, plan::text, max_seq, parked_before, approved_count, approved_by, approved_at
  FROM messaging_admin_approval
 ORDER BY approved_at DESC
 LIMIT 100`

// operationsQuery: the most recent executions in the journal
// (messaging_admin_operation).
const operationsQuery = `
SELECT approval_ticket, operation, state, owner, items_completed, started_at, updated_at,
       coalesce(completed_at, 'epoch'::timestamptz), coalesce(failure_code, ''), coalesce(failure_detail, ''),
       array_to_string(executed_by, ', '), array_to_string(forced_by, ', ')
  FROM messaging_admin_operation
 ORDER BY started_at DESC
 LIMIT 100`

// breakersQuery: the open breakers of live relays (a breaker row outlives
// its relay until the relay's heartbeat is gone), as status reads them.
const breakersQuery = `
SELECT b.owner, b.destination, b.opened_at, coalesce(b.last_error, '')
  FROM messaging_relay_breaker b
  JOIN messaging_relay_heartbeat h ON h.owner = b.owner AND h.expires_at > $1
 ORDER BY b.destination, b.owner
 LIMIT 1000`

// oldestUndeliveredQuery: when the first row still waiting for a relay
// (lowest seq) was created: the CDC lag in time. The first entry of
// messaging_outbox_claimable_idx, so it costs one index probe however long
// the backlog is (min(created_at) would read all of it).
const oldestUndeliveredQuery = `
SELECT created_at FROM messaging_outbox
 WHERE published_at IS NULL AND parked_at IS NULL
 ORDER BY seq
 LIMIT 1`
