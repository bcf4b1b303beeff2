// The lane scheme's claim: which rows of a relay's lanes it reads, and what it records.

package fencing

import (
	"context"
	"strconv"
	"strings"
	"sync"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/lib/pq"
)

// laneExpr is the lane of row alias a in a table of n lanes: a keyed row's
// from its ordering key's hash (a key lives in one lane), an unkeyed row's
// from its seq, in runs of unkeyedRun consecutive rows (unkeyedLaneExpr).
func laneExpr(a string, n int) string {
	return `(CASE WHEN ` + a + `.ordering_key IS NULL THEN ` + unkeyedLaneExpr(a, n) +
		` ELSE (hashtext(` + a + `.ordering_key) & 2147483647) % ` + strconv.Itoa(n) + ` END)`
}

// unkeyedRun is how many consecutive unkeyed rows (by seq) share a lane,
// as a power of two (unkeyedRunShift). Rows written together sit on the
// same heap pages: a lane of runs reads a page for several of its rows,
// where a lane of hashed ids read one page per row (measured on 1 KB rows:
// a lane's 1,000 rows in 2.7-4 ms against 7.5-10 ms).
const (
	unkeyedRunShift = 5
	unkeyedRun      = 1 << unkeyedRunShift
)

// unkeyedLaneExpr is laneExpr for a row without an ordering key, written
// exactly as messaging_outbox_lane_idx's expression so the planner uses it.
func unkeyedLaneExpr(a string, n int) string {
	return `((` + a + `.seq >> ` + strconv.Itoa(unkeyedRunShift) + `) % ` + strconv.Itoa(n) + `)`
}

// claimableIn is claimable(a), and in the lane scheme also "in one of the
// owner's lanes ($18) and not held by it ($19, seqs)". The held seqs are read
// through a subquery, which PostgreSQL hashes once per statement: as
// "<> ALL ($19)" a generic plan compared every row with every held entry (a
// relay holds up to three batches, 3,000 rows).
func claimableIn(a string, lanes int) string {
	if lanes == 0 {
		return claimable(a)
	}
	return `(` + claimable(a) + ` AND ` + a + `.seq NOT IN (SELECT unnest($19::int8[])) AND ` + laneExpr(a, lanes) + ` = ANY ($18::int[]))`
}

// laneClaimFinish ends the lane scheme's claim: the rows of src (picked_ctid,
// seq, bytes, expired, park) cut at the byte budget as claimUpdate cuts them,
// kept only where their lane is still the owner's under a live lease,
// the rows to park parked (the claim's only row writes: a budget already
// spent, or a per-row lease of a relay built before lanes that expired on
// its last attempt), and what the owner now holds in each lane recorded in
// messaging_relay_lane_held under the lane's epoch: the rows it still held
// there ($19) and the new ones, with the attempts each had. The held rows
// come back as IN_FLIGHT under a lease whose token is the lane's epoch;
// nothing of them is written. The lane rows are read, not locked (the
// outcome writes hold them FOR SHARE); a takeover that commits before the
// record changes the held row's epoch, and the record then matches nothing
// in that lane, so its rows are not returned.
func laneClaimFinish(src string, lanes int) string {
	return strings.NewReplacer("{src}", src, "{lane}", laneExpr("o", lanes)).Replace(`, fits AS (
    SELECT b.picked_ctid, b.expired, b.park FROM (
        SELECT s.picked_ctid, s.expired, s.park,
               sum(s.bytes) OVER (ORDER BY s.seq ROWS UNBOUNDED PRECEDING) AS run,
               row_number() OVER (ORDER BY s.seq) AS n
          FROM {src} s) b
     WHERE $16::int8 = 0 OR (b.n = 1 AND $16::int8 > 0) OR b.run <= abs($16::int8)
),
own AS MATERIALIZED (
    SELECT array_agg(l.lane ORDER BY l.lane) AS lanes, array_agg(l.epoch ORDER BY l.lane) AS epochs,
           array_agg(l.lease_expires_at ORDER BY l.lane) AS expires
      FROM messaging_relay_lane l
     -- The lanes' leases run on the server's clock (TakeLanes), not on the
     -- claim's $1, which a caller may set to its own.
     WHERE l.lane = ANY ($18::int[]) AND l.owner = $2 AND l.lease_expires_at > now()
       AND $3::float8 IS NOT NULL -- the per-row lease, unused here
),
got AS MATERIALIZED (
    -- Each row finds its lane's epoch by position in one row of arrays:
    -- a join of the picked rows with the lanes (or with fits) is planned
    -- as a nested loop over CTEs, every row against every lane. What fits
    -- computed for a row (expired, park) is computed again from the same
    -- version of it.
    SELECT r.row_ctid, r.lane, r.seq, r.attempts, r.expired, r.park,
           w.epochs[r.i] AS epoch, w.expires[r.i] AS lane_expires
      FROM own w, LATERAL (
        SELECT o.ctid AS row_ctid, ({lane})::int AS lane, o.seq, o.attempts,
               o.status = 'IN_FLIGHT' AS expired, ` + parks("o") + ` AS park,
               array_position(w.lanes, ({lane})::int) AS i
          FROM messaging_outbox o
         WHERE o.ctid = ANY (ARRAY(SELECT picked_ctid FROM fits))) r
     WHERE r.i IS NOT NULL
)` + laneClaimWrites(lanes))
}

// laneClaimWrites ends a lane claim (of a table of lanes lanes) whose CTE
// got holds the rows taken (row_ctid, lane, epoch, lane_expires, expired,
// park, seq and attempts): it parks the rows to park, records what
// the owner holds in each lane, and returns the parked rows and the held
// ones (see laneClaimFinish), reading the held rows' columns once, by
// ctid (the version the claim read: nothing in the statement writes it),
// in one TID scan of the whole list. Joined back to got row by row, every
// row was a TID scan of its own, and PostgreSQL sizes the relation (an
// lseek) at every TID scan: a system call per claimed row (perf on a
// 200,000-row drain: 2.4 % of the server's CPU in those calls alone). A
// row finds its lane's epoch and lease by position in one row of arrays,
// as got did. The held rows' lease owner is not sent back with each of
// them: it is the claim's owner, and ClaimAppend fills it in.
func laneClaimWrites(lanes int) string {
	return `,
parked AS (
    UPDATE messaging_outbox o
       SET status = 'EXHAUSTED',
           attempts = o.attempts + CASE WHEN g.expired THEN 1 ELSE 0 END,
           lease_expires_at = NULL,
           parked_at = coalesce($1::timestamptz, now()),
           next_attempt_at = NULL,
           last_failure_code = CASE WHEN g.expired THEN '` + CodeLeaseExpired + `' ELSE '` + CodeBudgetSpent + `' END,
           last_failure_detail = CASE WHEN g.expired
               THEN 'lease of ' || coalesce(o.lease_owner, '?') || ' (token ' || o.lease_token || ') expired before an outcome was written'
               ELSE o.attempts || ' attempts already reach the budget of ' || $4 || '; last failure: '
                    || coalesce(o.last_failure_code, 'none') || coalesce(': ' || o.last_failure_detail, '') END
      FROM got g
     WHERE o.ctid = g.row_ctid AND g.park
    RETURNING ` + prefixed("o", claimColumns) + `
),
kept AS MATERIALIZED (
    -- What each lane's record still holds ($19): one query over every
    -- lane of the claim, computed once, so the set of held seqs is hashed
    -- once. Written per lane (a LATERAL over each lane's record beside the
    -- UPDATE), the set was hashed again for every lane: 4 of a 10 ms claim
    -- of 1,000 rows in 32 lanes. IS TRUE keeps the IN a hashed subplan: as
    -- a bare IN the planner made it a join, and with the CTEs' row
    -- estimates (2 rows for 1,000) a nested loop of every held id against
    -- every entry of the records (2,000,000 comparisons, 411 ms). The
    -- order of a record means nothing (a takeover charges every entry), so
    -- its entries are not sorted back into it (numbered WITH ORDINALITY
    -- and aggregated in that order: 0.5 to 0.7 µs more a claimed row on a
    -- 50,000-row drain); seqs and attempts stay paired, both aggregated
    -- from the same rows.
    SELECT w.lane, array_agg(x.s) AS seqs, array_agg(x.att) AS atts
      FROM messaging_relay_lane_held w
      CROSS JOIN LATERAL unnest(w.held_seqs, w.held_attempts) AS x(s, att)
     WHERE w.lane IN (SELECT g.lane FROM got g WHERE NOT g.park)
       AND (x.s IN (SELECT unnest($19::int8[]))) IS TRUE
     GROUP BY w.lane
),
record AS (
    UPDATE messaging_relay_lane_held d
       SET held_seqs = coalesce(k.seqs, '{}') || h.seqs, held_attempts = coalesce(k.atts, '{}') || h.atts
      FROM (SELECT g.lane, g.epoch, array_agg(g.seq) AS seqs, array_agg(g.attempts) AS atts
              FROM got g WHERE NOT g.park GROUP BY g.lane, g.epoch) h
      LEFT JOIN kept k ON k.lane = h.lane
     WHERE d.lane = h.lane AND d.epoch = h.epoch
       -- locked in lane order first, as a takeover locks them (takeLanesSQL)
       AND d.lane IN (SELECT k.lane FROM messaging_relay_lane_held k
                       WHERE k.lane IN (SELECT g.lane FROM got g WHERE NOT g.park) ORDER BY k.lane FOR NO KEY UPDATE)
    RETURNING d.lane
),
held AS MATERIALIZED (
    SELECT array_agg(g.row_ctid) AS ctids
      FROM got g WHERE NOT g.park AND g.lane = ANY (ARRAY(SELECT lane FROM record))
),
leases AS MATERIALIZED (
    SELECT array_agg(l.lane ORDER BY l.lane) AS lanes, array_agg(l.epoch ORDER BY l.lane) AS epochs,
           array_agg(l.lane_expires ORDER BY l.lane) AS expires
      FROM (SELECT DISTINCT g.lane, g.epoch, g.lane_expires FROM got g) l
)
SELECT * FROM parked
UNION ALL
SELECT o.message_id, o.destination, o.payload, o.headers, 'IN_FLIGHT', o.seq, o.created_at,
       o.occurred_at, NULL::timestamptz, o.attempts, NULL::timestamptz, NULL::text, x.epochs[x.i],
       x.expires[x.i], o.last_failure_code, o.last_failure_detail, NULL::timestamptz, o.producer,
       o.correlation_id, o.causation_id, o.tenant, o.partition_key, o.ordering_key, o.traceparent,
       o.tracestate, o.baggage, o.schema_subject, o.schema_version, o.content_type, o.message_type,
       o.aggregate_type, o.aggregate_id, o.aggregate_version, NULL::timestamptz, o.routing_key
  FROM messaging_outbox o CROSS JOIN LATERAL (
        SELECT w.epochs, w.expires, array_position(w.lanes, (` + laneExpr("o", lanes) + `)::int) AS i FROM leases w) x
 WHERE o.ctid = ANY ((SELECT h.ctids FROM held h)::tid[]) -- the cast makes it the array form of ANY, not the subquery form`
}

// prefixed qualifies every column of the list cols with alias a.
func prefixed(a, cols string) string {
	parts := strings.Split(cols, ",")
	for i, c := range parts {
		c = strings.TrimSpace(c)
		if !strings.HasPrefix(c, "NULL::") {
			c = a + "." + c
		}
		parts[i] = c
	}
	return strings.Join(parts, ", ")
}

// laneClaims caches the lane scheme's claim statements by lane count and
// policy; laneStatements is every statement of the lane scheme generated so
// far (Prepared prepares them).
var (
	laneClaims     sync.Map // laneKey -> string
	laneStatements sync.Map // string -> bool
)

type laneKey struct {
	lanes int
	what  string
}

func laneStatement(k laneKey, build func() string) string {
	if q, ok := laneClaims.Load(k); ok {
		return q.(string)
	}
	q := build()
	laneStatements.Store(q, true)
	laneClaims.Store(k, q)
	return q
}

// runHead is the first seq at or above from (an SQL expression) of the
// unkeyed rows of lane (an SQL expression) in a table of lanes lanes that
// are neither published nor parked: one descent of
// messaging_outbox_lane_idx, in order (ORDER BY seq LIMIT 1 stops at the
// first entry it finds; a bitmap scan would collect every entry of the
// range first).
func runHead(lanes int, lane, from string) string {
	return `SELECT o.seq FROM messaging_outbox o
         WHERE ` + unkeyedLaneExpr("o", lanes) + ` = ` + lane + `
           AND o.ordering_key IS NULL AND o.published_at IS NULL AND o.parked_at IS NULL AND o.seq >= ` + from + `
         ORDER BY o.seq
         LIMIT 1`
}

// runRows is the condition (on alias o) that reads the claimable unkeyed
// rows of the run that starts at seq s (an SQL expression) and are not
// held ($19), followed by the LIMIT of a run: a run has no more rows, and
// the LIMIT also keeps the read a loop over the runs (joined as a flat
// join, the runs were scanned again for every row of the table's range).
func runRows(s string) string {
	return `o.seq BETWEEN ` + s + ` AND (` + s + ` | ` + strconv.Itoa(unkeyedRun-1) + `)
           AND o.ordering_key IS NULL AND ` + claimable("o") + ` AND o.seq NOT IN (SELECT unnest($19::int8[]))
         LIMIT ` + strconv.Itoa(unkeyedRun)
}

// unkeyedRunsCTE is the walk over the runs of the lanes $18 that the full
// lane claim's unkeyed half reads (unkeyedHalf), as laneUnkeyedClaimSQL's
// runs: the first run of each lane at or above greatest($6, the lane's
// floor), in the array's order, then each lane's next run, one descent
// each; read lazily, so it stops once the claim has its rows.
func unkeyedRunsCTE(lanes int) string {
	return `
unkeyed_runs(lane, s) AS (
    SELECT ln.lane, f.seq FROM unnest($18::int[]) AS ln(lane) CROSS JOIN LATERAL (` +
		runHead(lanes, "ln.lane", "greatest($6, (SELECT fl.floor_seq FROM messaging_relay_lane fl WHERE fl.lane = ln.lane))") + `) f
  UNION ALL
    SELECT r.lane, f.seq FROM unkeyed_runs r CROSS JOIN LATERAL (` +
		runHead(lanes, "r.lane", nextRun("r.s")) + `) f
),`
}

// nextRun is the first seq of the run after the one holding seq s (an SQL
// expression).
func nextRun(s string) string {
	shift := strconv.Itoa(unkeyedRunShift)
	return "((" + s + " >> " + shift + ") + 1) << " + shift
}

// laneUnkeyedClaimSQL is the lane claim without the walk over keys and
// without continuations (as claimUnkeyedSQL is for the per-row scheme):
// planning the full statement costs more than running it. Its parameters
// are renumbered: $1 now, $2 owner, $3 lease, $4 budget, $5 limit, $6 from
// seq, $7 excluded destinations, $8 only destination, $9 byte budget, $10
// lanes, $11 held.
//
// An unkeyed row's lane is its run of unkeyedRun seqs, so a lane is read a
// run at a time: the walk (runs) finds the first claimable seq of each of
// the owner's lanes at or above the start point, then the first of the
// lane's next run, one index descent each (ORDER BY seq LIMIT 1 on
// messaging_outbox_lane_idx; a lane's first descent starts at
// greatest(start point, the lane's floor): floor.go); each run's rows are read by their seq range
// and judged there. The walk goes lane by lane, a run of each at a time,
// and stops once the claim has its rows: a claim reads its rows and a
// descent per run, however long the lanes are. Read as one scan per lane,
// ordered and cut at the limit, the lane was read whole whenever the
// planner's estimates favoured a bitmap (they did, on custom and generic
// plans, with small rows or with the claimability conditions in view): a
// claim of 1,000 rows on a 200,000-row backlog read 6,271 rows of its
// first lane and sorted them, and a bitmap scan never marks the dead index
// entries it meets, so it got slower with every round of published rows.
// The rows are cut at the byte budget, what spent its budget is parked and
// the rest recorded as held (laneClaimFinish explains both).
//
// The claim's limit is read through a sub-select, which the planner never
// folds into a constant: given the value, the custom plans of a claim of 1
// to 10 rows were always estimated cheaper than the generic plan, so the
// prepared statement never switched to it and every such claim was planned
// again (2.3 and 3.1 ms a claim at limits 1 and 10, against 1.1 and 1.5 on
// the generic plan: TestClaimsSwitchToTheirGenericPlans). With the limit
// unknown, its custom and generic plans still read the lanes through their
// index on a large analyzed backlog
// (TestCustomPlansOfTheClaimsReadNoTableWhole).
func laneUnkeyedClaimSQL(lanes int, anyDest bool) string {
	if anyDest {
		return laneStatement(laneKey{lanes, "claim-unkeyed-any"}, func() string { return anyDestination(laneUnkeyedClaimSQL(lanes, false)) })
	}
	return laneStatement(laneKey{lanes, "claim-unkeyed"}, func() string {
		q := `
WITH RECURSIVE own AS MATERIALIZED (
    SELECT l.lane, l.epoch, l.lease_expires_at, l.floor_seq
      FROM messaging_relay_lane l
     WHERE l.lane = ANY ($18::int[]) AND l.owner = $2 AND l.lease_expires_at > now()
       AND $3::float8 IS NOT NULL -- the per-row lease, unused here
),
runs(lane, epoch, lane_expires, s) AS (
    SELECT w.lane, w.epoch, w.lease_expires_at, f.seq
      FROM own w CROSS JOIN LATERAL (` + runHead(lanes, "w.lane", "greatest($6, w.floor_seq)") + `) f
    UNION ALL
    SELECT r.lane, r.epoch, r.lane_expires, f.seq
      FROM runs r CROSS JOIN LATERAL (` + runHead(lanes, "r.lane", nextRun("r.s")) + `) f
),
unkeyed AS MATERIALIZED (
    SELECT u.* FROM runs r CROSS JOIN LATERAL (
        SELECT o.ctid AS row_ctid, r.lane, r.epoch, r.lane_expires AS lane_expires,
               ` + rowBytes + ` AS bytes, o.status = 'IN_FLIGHT' AS expired, ` + parks("o") + ` AS park,
               o.seq, o.attempts
          FROM messaging_outbox o
         WHERE ` + runRows("r.s") + `) u
     ` + hiddenLimit("$12") + `
),
got AS MATERIALIZED (
    SELECT b.* FROM (
        SELECT s.*, sum(s.bytes) OVER (ORDER BY s.seq ROWS UNBOUNDED PRECEDING) AS run,
               row_number() OVER (ORDER BY s.seq) AS n
          FROM unkeyed s) b
     WHERE $16::int8 = 0 OR (b.n = 1 AND $16::int8 > 0) OR b.run <= abs($16::int8)
)` + laneClaimWrites(lanes)
		return strings.NewReplacer("$12", "$5", "$14", "$7", "$15", "$8", "$16", "$9", "$18", "$10", "$19", "$11").Replace(q)
	})
}

func laneClaimSQL(policy OrderingPolicy, lanes int, anyDest bool) string {
	if anyDest {
		return laneStatement(laneKey{lanes, "claim-" + policy.String() + "-any"}, func() string { return anyDestination(laneClaimSQL(policy, lanes, false)) })
	}
	if policy == SkipParked {
		return laneStatement(laneKey{lanes, "claim-skip-parked"}, func() string { return claimSQL(skipParked, lanes) })
	}
	return laneStatement(laneKey{lanes, "claim-block-key"}, func() string { return claimSQL("", lanes) })
}

// laneArgs are the two parameters the lane scheme adds to a claim.
func laneArgs(p ClaimParams) []any {
	lanes := make([]int64, len(p.Lanes))
	for i, l := range p.Lanes {
		lanes[i] = int64(l)
	}
	return []any{pq.Array(lanes), pq.Array(append([]int64{}, p.HeldSeqs...))}
}

// seqsOf looks up the seqs of the rows with message ids ids (ClaimParams.Held).
func seqsOf(ctx context.Context, db DBTX, ids []string) ([]int64, error) {
	rows, err := db.QueryContext(ctx, `SELECT seq FROM messaging_outbox WHERE message_id = ANY ($1::text[])`, pq.Array(ids))
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	seqs := make([]int64, 0, len(ids))
	for rows.Next() {
		var s int64
		if err := rows.Scan(&s); err != nil {
			return nil, err
		}
		seqs = append(seqs, s)
	}
	return seqs, rows.Err()
}

func checkLaneParams(op string, p ClaimParams) error {
	switch {
	case p.LaneCount <= 0 || p.LaneCount > MaxLanes:
		return outbox.Errorf(CodeInvalidArgument, op, "a lane claim needs the table's lane count, between 1 and %d, got %d", MaxLanes, p.LaneCount)
	case len(p.Lanes) == 0:
		return outbox.Errorf(CodeInvalidArgument, op, "a lane claim needs at least one lane")
	}
	for _, l := range p.Lanes {
		if l < 0 || l >= p.LaneCount {
			return outbox.Errorf(CodeInvalidArgument, op, "lane %d is not one of the table's %d lanes", l, p.LaneCount)
		}
	}
	return nil
}
