// Lanes: the fence on a lane instead of on each row (migration 00050).
//
// Every row belongs to one lane, (hashtext(coalesce(ordering_key,
// message_id)) & 2147483647) % N. A relay owns lanes (messaging_relay_lane:
// owner, epoch, lease), reads its lanes' claimable rows without writing
// them ([ClaimParams].Lanes), records once per claim what it holds in each
// lane, and writes each row once, its outcome, fenced by the lane's owner
// and epoch ([Apply] with lane leases). A relay that takes a lane whose
// lease expired charges an attempt to each row its previous owner held
// there and wrote no outcome for.

package fencing

import (
	"context"
	"database/sql"
	"fmt"
	"math"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/lib/pq"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
)

// Codes of the lane scheme.
const (
	// CodeFenceConflict: a relay of one fence scheme (per-row leases or
	// lanes) was asked to run while a live relay of the other runs against
	// the same database. The database refuses per-row leases itself while
	// the fleet runs on lanes (a trigger raises it), so a relay built before
	// lanes claims nothing there.
	CodeFenceConflict outbox.Code = "FENCE_SCHEME_CONFLICT"
	// CodeLanesBusy: the lane count cannot change while a lane is owned.
	CodeLanesBusy outbox.Code = "LANES_BUSY"
	// CodeLanesMissing: the schema has no lanes (migration 00050 not
	// applied, or its rows deleted).
	CodeLanesMissing outbox.Code = "LANES_MISSING"
)

// ErrFenceConflict matches CodeFenceConflict with errors.Is.
var ErrFenceConflict = &outbox.Error{Code: CodeFenceConflict}

// ErrLanesBusy matches CodeLanesBusy with errors.Is.
var ErrLanesBusy = &outbox.Error{Code: CodeLanesBusy}

// MaxLanes bounds the lane count (the table's CHECK).
const MaxLanes = 4096

// laneExpr is the lane of row alias a in a table of n lanes.
func laneExpr(a string, n int) string {
	return `((hashtext(coalesce(` + a + `.ordering_key, ` + a + `.message_id)) & 2147483647) % ` + strconv.Itoa(n) + `)`
}

// unkeyedLaneExpr is laneExpr for a row without an ordering key, written
// exactly as messaging_outbox_lane_idx's expression so the planner uses it.
func unkeyedLaneExpr(a string, n int) string {
	return `((hashtext(` + a + `.message_id) & 2147483647) % ` + strconv.Itoa(n) + `)`
}

// claimableIn is claimable(a), and in the lane scheme also "in one of the
// owner's lanes ($18) and not held by it ($19)". The held ids are read
// through a subquery, which PostgreSQL hashes once per statement: as
// "<> ALL ($19)" a generic plan compared every row with every held id (a
// relay holds up to three batches, 3,000 ids).
func claimableIn(a string, lanes int) string {
	if lanes == 0 {
		return claimable(a)
	}
	return `(` + claimable(a) + ` AND ` + a + `.message_id NOT IN (SELECT unnest($19::text[])) AND ` + laneExpr(a, lanes) + ` = ANY ($18::int[]))`
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
    SELECT l.lane, l.epoch, l.lease_expires_at
      FROM messaging_relay_lane l
     -- The lanes' leases run on the server's clock (TakeLanes), not on the
     -- claim's $1, which a caller may set to its own.
     WHERE l.lane = ANY ($18::int[]) AND l.owner = $2 AND l.lease_expires_at > now()
       AND $3::float8 IS NOT NULL -- the per-row lease, unused here
),
picked_rows AS MATERIALIZED (
    SELECT o.ctid AS row_ctid, {lane} AS lane,
           o.message_id, o.destination, o.payload, o.headers, o.status, o.seq, o.created_at, o.occurred_at,
           o.attempts, o.lease_owner, o.lease_token, o.last_failure_code, o.last_failure_detail,
           o.producer, o.correlation_id, o.causation_id, o.tenant, o.partition_key, o.ordering_key,
           o.traceparent, o.tracestate, o.baggage, o.schema_subject, o.schema_version, o.content_type,
           o.message_type, o.aggregate_type, o.aggregate_id, o.aggregate_version, o.routing_key
      FROM messaging_outbox o
     WHERE o.ctid = ANY (ARRAY(SELECT picked_ctid FROM fits))
),
got AS MATERIALIZED (
    SELECT r.*, p.park, p.expired, w.epoch, w.lease_expires_at AS lane_expires
      FROM picked_rows r
      JOIN fits p ON p.picked_ctid = r.row_ctid
      JOIN own w ON w.lane = r.lane
),
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
record AS (
    UPDATE messaging_relay_lane_held d
       SET held_ids = k.ids || h.ids, held_attempts = k.atts || h.atts
      FROM (SELECT g.lane, g.epoch, array_agg(g.message_id) AS ids, array_agg(g.attempts) AS atts
              FROM got g WHERE NOT g.park GROUP BY g.lane, g.epoch) h
      JOIN messaging_relay_lane_held w ON w.lane = h.lane
      CROSS JOIN LATERAL (
            SELECT coalesce(array_agg(x.id ORDER BY x.i), '{}') AS ids, coalesce(array_agg(x.att ORDER BY x.i), '{}') AS atts
              FROM unnest(w.held_ids, w.held_attempts) WITH ORDINALITY AS x(id, att, i)
             WHERE x.id IN (SELECT unnest($19::text[]))) k
     WHERE d.lane = h.lane AND d.epoch = h.epoch
    RETURNING d.lane
)
SELECT * FROM parked
UNION ALL
SELECT g.message_id, g.destination, g.payload, g.headers, 'IN_FLIGHT', g.seq, g.created_at,
       g.occurred_at, NULL::timestamptz, g.attempts, NULL::timestamptz, $2, g.epoch,
       g.lane_expires, g.last_failure_code, g.last_failure_detail, NULL::timestamptz, g.producer,
       g.correlation_id, g.causation_id, g.tenant, g.partition_key, g.ordering_key, g.traceparent,
       g.tracestate, g.baggage, g.schema_subject, g.schema_version, g.content_type, g.message_type,
       g.aggregate_type, g.aggregate_id, g.aggregate_version, NULL::timestamptz, g.routing_key
  FROM got g
 WHERE NOT g.park AND g.lane IN (SELECT lane FROM record)`)
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

// laneUnkeyedClaimSQL is the lane claim without the walk over keys and
// without continuations (as claimUnkeyedSQL is for the per-row scheme):
// planning the full statement costs more than running it. Its parameters
// are renumbered: $1 now, $2 owner, $3 lease, $4 budget, $5 limit, $6 from
// seq, $7 excluded destinations, $8 only destination, $9 byte budget, $10
// lanes, $11 held.
func laneUnkeyedClaimSQL(lanes int) string {
	return laneStatement(laneKey{lanes, "claim-unkeyed"}, func() string {
		q := `
WITH unkeyed AS (` + unkeyedHalf(lanes) + `
)
` + laneClaimFinish("unkeyed", lanes)
		return strings.NewReplacer("$12", "$5", "$14", "$7", "$15", "$8", "$16", "$9", "$18", "$10", "$19", "$11").Replace(q)
	})
}

func laneClaimSQL(policy OrderingPolicy, lanes int) string {
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
	return []any{pq.Array(lanes), pq.Array(append([]string{}, p.Held...))}
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

// LaneCount returns the number of lanes of the schema (the rows of
// messaging_relay_lane), LANES_MISSING when it has none.
func LaneCount(ctx context.Context, db DBTX) (int, error) {
	var n int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM messaging_relay_lane`).Scan(&n); err != nil {
		return 0, fmt.Errorf("fencing.LaneCount: %w", err)
	}
	if n == 0 {
		return 0, outbox.Errorf(CodeLanesMissing, "fencing.LaneCount", "messaging_relay_lane has no rows: run the migrations (00050)")
	}
	return n, nil
}

// LaneLease is a lane a relay owns: valid while its owner and epoch are the
// lane's.
type LaneLease struct {
	Lane      int
	Epoch     int64
	ExpiresAt time.Time
}

// LaneParams configure [TakeLanes].
type LaneParams struct {
	Owner       string        // required
	TTL         time.Duration // the lanes' lease from now; > 0
	MaxAttempts int           // the budget the charges of a takeover park at; > 0
}

// LaneState is what [TakeLanes] found: the lanes the owner holds now and its
// fair share, ceil(lanes / live polling relays).
type LaneState struct {
	Owned []LaneLease // in lane order
	Taken []int       // the lanes of Owned taken by this call
	Share int
	Total int
	// Charged are the rows a takeover charged an attempt (their previous
	// owner's lease on the lane expired while it held them); Parked those
	// of them that spent their budget and are now EXHAUSTED.
	Charged, Parked int
}

// takeLanesSQL renews every lane of $1 (one statement per heartbeat), marks
// its heartbeat as a lane relay's, and takes unowned or expired lanes up to
// its fair share: ceil(lanes / live polling relays), preferring unowned
// ones. Each lane taken gets a new epoch; the rows its expired owner held
// there and wrote no outcome for (the same attempts as recorded) are
// charged an attempt, and parked EXHAUSTED when that spends the budget $3.
const takeLanesSQL = `
WITH beat AS (
    UPDATE messaging_relay_heartbeat SET fence = 'LANES' WHERE owner = $1 AND fence IS DISTINCT FROM 'LANES'
),
total AS (SELECT count(*)::int AS n FROM messaging_relay_lane),
live AS (
    SELECT 1 + count(*)::int AS n FROM messaging_relay_heartbeat
     WHERE kind = 'POLLING' AND expires_at > now() AND owner <> $1
),
share AS (SELECT ((SELECT n FROM total) + (SELECT n FROM live) - 1) / (SELECT n FROM live) AS n),
renewed AS (
    UPDATE messaging_relay_lane
       SET lease_expires_at = now() + make_interval(secs => $2)
     WHERE owner = $1
    RETURNING lane, epoch, lease_expires_at
),
want AS (
    SELECT greatest(0, (SELECT n FROM share) - (SELECT count(*) FROM messaging_relay_lane WHERE owner = $1)) AS n
),
cand AS MATERIALIZED (
    SELECT l.lane, l.owner AS old_owner, l.epoch AS old_epoch
      FROM messaging_relay_lane l
     WHERE l.owner IS NULL OR (l.lease_expires_at <= now() AND l.owner <> $1)
     ORDER BY l.owner IS NOT NULL, l.lane
     LIMIT (SELECT n FROM want)
       FOR NO KEY UPDATE SKIP LOCKED
),
held AS MATERIALIZED (
    SELECT d.lane, d.held_ids, d.held_attempts
      FROM messaging_relay_lane_held d JOIN cand c ON c.lane = d.lane
       FOR UPDATE OF d
),
taken AS (
    UPDATE messaging_relay_lane l
       SET owner = $1, epoch = l.epoch + 1, lease_expires_at = now() + make_interval(secs => $2), changed_at = now()
      FROM cand c
     WHERE l.lane = c.lane
    RETURNING l.lane, l.epoch, l.lease_expires_at
),
cleared AS (
    UPDATE messaging_relay_lane_held d
       SET epoch = c.old_epoch + 1, held_ids = '{}', held_attempts = '{}'
      FROM cand c
     WHERE d.lane = c.lane
),
charged AS (
    UPDATE messaging_outbox o
       SET attempts = o.attempts + 1,
           status = CASE WHEN o.attempts + 1 >= $3 THEN 'EXHAUSTED' ELSE 'AMBIGUOUS' END,
           parked_at = CASE WHEN o.attempts + 1 >= $3 THEN now() ELSE NULL END,
           next_attempt_at = NULL,
           last_attempt_at = now(),
           last_failure_code = '` + CodeLeaseExpired + `',
           last_failure_detail = 'lane ' || h.lane || ' of ' || h.old_owner || ' (epoch ' || h.old_epoch
                                 || ') expired while it held this row; no outcome was written'
      FROM (SELECT c.lane, c.old_owner, c.old_epoch, x.id, x.att
              FROM cand c JOIN held d ON d.lane = c.lane
             CROSS JOIN LATERAL unnest(d.held_ids, d.held_attempts) AS x(id, att)) h
     WHERE o.message_id = h.id AND o.attempts = h.att
       AND o.published_at IS NULL AND o.parked_at IS NULL AND o.status <> 'IN_FLIGHT'
    RETURNING o.status
)
SELECT lane, epoch, lease_expires_at, false AS taken, (SELECT n FROM share), (SELECT n FROM total),
       (SELECT count(*) FROM charged), (SELECT count(*) FROM charged WHERE status = 'EXHAUSTED')
  FROM renewed
UNION ALL
SELECT lane, epoch, lease_expires_at, true, (SELECT n FROM share), (SELECT n FROM total),
       (SELECT count(*) FROM charged), (SELECT count(*) FROM charged WHERE status = 'EXHAUSTED')
  FROM taken
UNION ALL
SELECT -1, 0, NULL, false, (SELECT n FROM share), (SELECT n FROM total),
       (SELECT count(*) FROM charged), (SELECT count(*) FROM charged WHERE status = 'EXHAUSTED')`

// TakeLanes renews every lane p.Owner holds and takes more, up to its fair
// share, in one statement (see takeLanesSQL). A relay calls it at start and
// then well within the lanes' TTL; it gives lanes over its share back with
// [GiveBackLanes] once it finished what it holds in them.
func TakeLanes(ctx context.Context, db DBTX, p LaneParams) (LaneState, error) {
	const op = "fencing.TakeLanes"
	switch {
	case p.Owner == "":
		return LaneState{}, outbox.Errorf(CodeInvalidArgument, op, "owner must not be empty")
	case p.TTL <= 0:
		return LaneState{}, outbox.Errorf(CodeInvalidArgument, op, "lane TTL must be > 0, got %s", p.TTL)
	case p.MaxAttempts <= 0 || p.MaxAttempts > math.MaxInt32:
		return LaneState{}, outbox.Errorf(CodeInvalidArgument, op, "max attempts must be between 1 and %d, got %d", math.MaxInt32, p.MaxAttempts)
	}
	rows, err := db.QueryContext(ctx, takeLanesSQL, p.Owner, p.TTL.Seconds(), p.MaxAttempts)
	if err != nil {
		return LaneState{}, fmt.Errorf("%s: %w", op, err)
	}
	defer rows.Close()
	var st LaneState
	for rows.Next() {
		var l LaneLease
		var exp *time.Time
		var taken bool
		if err := rows.Scan(&l.Lane, &l.Epoch, &exp, &taken, &st.Share, &st.Total, &st.Charged, &st.Parked); err != nil {
			return LaneState{}, fmt.Errorf("%s: %w", op, err)
		}
		if l.Lane < 0 {
			continue
		}
		l.ExpiresAt = *exp
		st.Owned = append(st.Owned, l)
		if taken {
			st.Taken = append(st.Taken, l.Lane)
		}
	}
	if err := rows.Err(); err != nil {
		return LaneState{}, fmt.Errorf("%s: %w", op, err)
	}
	if st.Total == 0 {
		return LaneState{}, outbox.Errorf(CodeLanesMissing, op, "messaging_relay_lane has no rows: run the migrations (00050)")
	}
	sortLanes(st.Owned)
	return st, nil
}

func sortLanes(ls []LaneLease) {
	for i := 1; i < len(ls); i++ {
		for j := i; j > 0 && ls[j].Lane < ls[j-1].Lane; j-- {
			ls[j], ls[j-1] = ls[j-1], ls[j]
		}
	}
}

// giveBackSQL ends owner $1's lease on the lanes $2: no owner, a new epoch,
// nothing held.
const giveBackSQL = `
WITH back AS (
    UPDATE messaging_relay_lane
       SET owner = NULL, lease_expires_at = NULL, epoch = epoch + 1, changed_at = now()
     WHERE owner = $1 AND lane = ANY ($2::int[])
    RETURNING lane, epoch
),
cleared AS (
    UPDATE messaging_relay_lane_held d SET epoch = b.epoch, held_ids = '{}', held_attempts = '{}'
      FROM back b WHERE d.lane = b.lane
)
SELECT lane FROM back`

// GiveBackLanes gives the lanes back (all of owner's when lanes is nil)
// and returns those it gave back. The caller must hold nothing in them: what
// it held there is forgotten, not charged.
func GiveBackLanes(ctx context.Context, db DBTX, owner string, lanes []int) ([]int, error) {
	const op = "fencing.GiveBackLanes"
	if owner == "" {
		return nil, outbox.Errorf(CodeInvalidArgument, op, "owner must not be empty")
	}
	q, args := giveBackSQL, []any{owner, nil}
	if lanes == nil {
		q = strings.Replace(giveBackSQL, " AND lane = ANY ($2::int[])", "", 1)
		args = args[:1]
	} else {
		ls := make([]int64, len(lanes))
		for i, l := range lanes {
			ls[i] = int64(l)
		}
		args[1] = pq.Array(ls)
	}
	rows, err := db.QueryContext(ctx, q, args...)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", op, err)
	}
	defer rows.Close()
	var out []int
	for rows.Next() {
		var l int
		if err := rows.Scan(&l); err != nil {
			return nil, fmt.Errorf("%s: %w", op, err)
		}
		out = append(out, l)
	}
	return out, rows.Err()
}

// Fence schemes, as messaging_relay_mode.fence records them.
const (
	FenceRows  = "ROWS"
	FenceLanes = "LANES"
)

// enterFenceSQL records scheme $2 as the fleet's unless a live polling relay
// other than $1 runs the other scheme (heartbeat fence NULL is the per-row
// scheme), and returns that relay.
const enterFenceSQL = `
WITH other AS (
    SELECT h.owner FROM messaging_relay_heartbeat h
     WHERE h.kind = 'POLLING' AND h.expires_at > now() AND h.owner <> $1
       AND coalesce(h.fence, 'ROWS') <> $2
     ORDER BY h.owner LIMIT 1
),
mine AS (
    UPDATE messaging_relay_heartbeat SET fence = $2 WHERE owner = $1 AND $2 = 'LANES'
),
flip AS (
    UPDATE messaging_relay_mode SET fence = $2
     WHERE id AND fence <> $2 AND NOT EXISTS (SELECT 1 FROM other)
)
SELECT (SELECT owner FROM other)`

// EnterFence makes scheme (FenceRows or FenceLanes) the fleet's, for the
// relay owner that is about to run it, and refuses with
// FENCE_SCHEME_CONFLICT while a live polling relay of the other scheme
// runs. A relay calls it after its first heartbeat and before it claims.
func EnterFence(ctx context.Context, db DBTX, owner, scheme string) error {
	const op = "fencing.EnterFence"
	if owner == "" {
		return outbox.Errorf(CodeInvalidArgument, op, "owner must not be empty")
	}
	if scheme != FenceRows && scheme != FenceLanes {
		return outbox.Errorf(CodeInvalidArgument, op, "fence scheme must be %s or %s, got %q", FenceRows, FenceLanes, scheme)
	}
	var other *string
	if err := db.QueryRowContext(ctx, enterFenceSQL, owner, scheme).Scan(&other); err != nil {
		return fmt.Errorf("%s: %w", op, err)
	}
	if other != nil {
		return outbox.Errorf(CodeFenceConflict, op,
			"relay %q of the other fence scheme is live; a fleet runs one scheme at a time (stop it first, or wait for its heartbeat to expire)", *other)
	}
	return nil
}

// SetLaneCount changes the number of lanes to n. It refuses with
// LANES_BUSY while any lane is owned (stop the relays first, or wait for
// their lanes' leases to expire): with no owner nothing is in flight that
// a lane records. It then charges the rows that expired owners left in
// flight (as a takeover does), replaces the lane rows and rebuilds
// messaging_outbox_lane_idx for n, in one transaction (the index build
// blocks writes to the outbox while it runs). The relays read the count
// when they start.
func SetLaneCount(ctx context.Context, db *sql.DB, n, maxAttempts int) error {
	const op = "fencing.SetLaneCount"
	if n <= 0 || n > MaxLanes {
		return outbox.Errorf(CodeInvalidArgument, op, "lane count must be between 1 and %d, got %d", MaxLanes, n)
	}
	if maxAttempts <= 0 || maxAttempts > math.MaxInt32 {
		return outbox.Errorf(CodeInvalidArgument, op, "max attempts must be between 1 and %d, got %d", math.MaxInt32, maxAttempts)
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("%s: %w", op, err)
	}
	defer tx.Rollback() //nolint:errcheck // after Commit a no-op
	if _, err := tx.ExecContext(ctx, `LOCK TABLE messaging_relay_lane IN EXCLUSIVE MODE`); err != nil {
		return fmt.Errorf("%s: %w", op, err)
	}
	var owner *string
	if err := tx.QueryRowContext(ctx, `SELECT min(owner) FROM messaging_relay_lane WHERE owner IS NOT NULL AND lease_expires_at > now()`).Scan(&owner); err != nil {
		return fmt.Errorf("%s: %w", op, err)
	}
	if owner != nil {
		return outbox.Errorf(CodeLanesBusy, op, "relay %q owns a lane; stop every relay (or wait for their lanes to expire) before changing the lane count", *owner)
	}
	stmts := []string{
		`UPDATE messaging_outbox o
            SET attempts = o.attempts + 1,
                status = CASE WHEN o.attempts + 1 >= $1 THEN 'EXHAUSTED' ELSE 'AMBIGUOUS' END,
                parked_at = CASE WHEN o.attempts + 1 >= $1 THEN now() ELSE NULL END,
                next_attempt_at = NULL, last_attempt_at = now(),
                last_failure_code = '` + CodeLeaseExpired + `',
                last_failure_detail = 'lane ' || h.lane || ' of ' || h.owner || ' expired while it held this row; no outcome was written'
           FROM (SELECT l.lane, l.owner, x.id, x.att FROM messaging_relay_lane l
                   JOIN messaging_relay_lane_held d ON d.lane = l.lane AND d.epoch = l.epoch
                   CROSS JOIN LATERAL unnest(d.held_ids, d.held_attempts) AS x(id, att)
                  WHERE l.owner IS NOT NULL) h
          WHERE o.message_id = h.id AND o.attempts = h.att
            AND o.published_at IS NULL AND o.parked_at IS NULL AND o.status <> 'IN_FLIGHT'`,
		`DELETE FROM messaging_relay_lane`,
		`INSERT INTO messaging_relay_lane (lane) SELECT g FROM generate_series(0, $1 - 1) g`,
		`INSERT INTO messaging_relay_lane_held (lane) SELECT g FROM generate_series(0, $1 - 1) g`,
		`DROP INDEX IF EXISTS messaging_outbox_lane_idx`,
		`CREATE INDEX messaging_outbox_lane_idx ON messaging_outbox (` + strings.ReplaceAll(unkeyedLaneExpr("o", n), "o.", "") + `, seq)
            WHERE ordering_key IS NULL AND published_at IS NULL AND parked_at IS NULL`,
	}
	args := [][]any{{maxAttempts}, nil, {n}, {n}, nil, nil}
	for i, q := range stmts {
		if _, err := tx.ExecContext(ctx, q, args[i]...); err != nil {
			return fmt.Errorf("%s: %w", op, err)
		}
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("%s: %w", op, err)
	}
	return nil
}

// The lane scheme's outcome statements: applySQL and applyPublishedSQL with
// the fence moved from the row's lease to its lane. Each first locks every
// lane of the owner ($4 / $2) FOR SHARE (a takeover's UPDATE of a lane waits
// until the outcome commits, and an outcome that waited for a takeover
// finds the lane changed), then writes a row only when its lane is still
// the owner's at the epoch its lease names and the row is as it was read:
// still claimable, with the attempts it had. The outcome is the row's only
// write: lease_owner and lease_token record who wrote it (the relay and
// the lane's epoch).
const laneFence = `
fence AS MATERIALIZED (
    SELECT l.lane, l.epoch FROM messaging_relay_lane l WHERE l.owner = {owner} FOR SHARE
)`

func laneFenceFor(lanes int, owner, token, attempts string) string {
	// The count reads (and so locks) every lane of the owner before any
	// row is written: a CTE is read lazily, and EXISTS alone would lock
	// only the lanes up to the one it looks for.
	return `(SELECT count(*) FROM fence) > 0
   AND o.published_at IS NULL AND o.parked_at IS NULL
   AND o.attempts = ` + attempts + `
   AND EXISTS (SELECT 1 FROM fence f WHERE f.lane = ` + laneExpr("o", lanes) + ` AND f.epoch = ` + token + `)`
}

func laneApplySQL(lanes int) string {
	return laneStatement(laneKey{lanes, "apply"}, func() string {
		return `
WITH` + strings.ReplaceAll(laneFence, "{owner}", "$4") + `
UPDATE messaging_outbox o
   SET (status, attempts, published_at, next_attempt_at, last_failure_code, last_failure_detail, parked_at, last_attempt_at) = (
       SELECT ` + outcomeStatus + `,
              o.attempts + CASE WHEN u.to_status = 'PENDING' THEN 0 ELSE 1 END + CASE WHEN o.status = 'IN_FLIGHT' THEN 1 ELSE 0 END,
` + outcomeColumns + `,
              CASE WHEN u.to_status = 'PENDING' THEN o.last_attempt_at ELSE c.t END
` + outcomeSource + `),
       lease_owner = $4,
       lease_token = ($3::jsonb -> o.message_id ->> 'token')::int8,
       lease_expires_at = NULL
 WHERE o.message_id = ANY ($2::text[])
   AND ` + laneFenceFor(lanes, "$4", "($3::jsonb -> o.message_id ->> 'token')::int8", "($3::jsonb -> o.message_id ->> 'attempts')::int") + `
RETURNING o.message_id`
	})
}

func laneApplyPublishedSQL(lanes int) string {
	return laneStatement(laneKey{lanes, "apply-published"}, func() string {
		return `
WITH` + strings.ReplaceAll(laneFence, "{owner}", "$2") + `
UPDATE messaging_outbox o
   SET status = 'PUBLISHED',
       attempts = o.attempts + CASE WHEN o.status = 'IN_FLIGHT' THEN 2 ELSE 1 END,
       published_at = coalesce($1::timestamptz, now()),
       last_attempt_at = coalesce($1::timestamptz, now()),
       next_attempt_at = NULL,
       lease_owner = $2,
       lease_token = ($4::jsonb -> o.message_id ->> 0)::int8,
       lease_expires_at = NULL
 WHERE o.message_id = ANY ($3::text[])
   AND ` + laneFenceFor(lanes, "$2", "($4::jsonb -> o.message_id ->> 0)::int8", "($4::jsonb -> o.message_id ->> 1)::int") + `
RETURNING o.message_id`
	})
}

// laneApplyStatement is applyStatement for lane leases (all of one owner,
// checked by Apply).
func laneApplyStatement(outcomes []Outcome, general bool) (string, []any) {
	lanes := outcomes[0].Lease.Lanes
	ids := make([]string, len(outcomes))
	for i, o := range outcomes {
		ids[i] = o.Lease.MessageID
	}
	var b jsonObject
	if !general {
		for _, o := range outcomes {
			b.key(o.Lease.MessageID)
			b.buf = append(b.buf, '[')
			b.buf = strconv.AppendInt(b.buf, o.Lease.Token, 10)
			b.buf = append(b.buf, ',')
			b.buf = strconv.AppendInt(b.buf, int64(o.Lease.Attempts), 10)
			b.buf = append(b.buf, ']')
		}
		return laneApplyPublishedSQL(lanes), []any{nowArg(outcomes[0].Now), outcomes[0].Lease.Owner, pq.Array(ids), b.close()}
	}
	for _, o := range outcomes {
		appendOutcome(&b, o)
		b.buf = b.buf[:len(b.buf)-1] // reopen the member to add the attempts read
		b.buf = append(b.buf, `,"attempts":`...)
		b.buf = strconv.AppendInt(b.buf, int64(o.Lease.Attempts), 10)
		b.buf = append(b.buf, '}')
	}
	return laneApplySQL(lanes), []any{nowArg(outcomes[0].Now), pq.Array(ids), b.close(), outcomes[0].Lease.Owner}
}

// plainRelease reports whether o gives a lane-held row back without
// anything to record: the row is as it was read, so nothing is written.
func plainRelease(o Outcome) bool {
	return o.Lease.Lanes > 0 && o.To == envelope.StatusPending && o.Code == "" && o.RetryAfter == 0
}
