// Lanes: the fence on a lane instead of on each row (migration 00050).
//
// Every row belongs to one lane: (hashtext(ordering_key) & 2147483647) % N
// for a keyed row, (seq >> 5) % N for an unkeyed one (runs of 32 rows in
// seq order, which share heap pages). A relay owns lanes (messaging_relay_lane:
// owner, epoch, lease), reads its lanes' claimable rows without writing
// them ([ClaimParams].Lanes), records once per claim what it holds in each
// lane, and writes each row once, its outcome, fenced by the lane's owner
// and epoch ([Apply] with lane leases). A relay that takes a lane whose
// lease expired charges an attempt to each row its previous owner held
// there and wrote no outcome for.

package fencing

import (
	"cmp"
	"context"
	"database/sql"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/lib/pq"

	outbox "github.com/fencedoutbox/watermill-outbox"
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

// noLanes is LANES_MISSING for op: the lane table has no rows.
func noLanes(op string) error {
	return outbox.Errorf(CodeLanesMissing, op, "messaging_relay_lane has no rows: run the migrations (00050)")
}

// LaneCount returns the number of lanes of the schema (the rows of
// messaging_relay_lane), LANES_MISSING when it has none.
func LaneCount(ctx context.Context, db DBTX) (int, error) {
	var n int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM messaging_relay_lane`).Scan(&n); err != nil {
		return 0, fmt.Errorf("fencing.LaneCount: %w", err)
	}
	if n == 0 {
		return 0, noLanes("fencing.LaneCount")
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
// fair share: the lanes split evenly between the live polling relays, the
// remainder one each to the first of them by owner name (in bytes), so the
// shares add up to the lane count.
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

// lockOwnLanes locks the lanes of owner $1 in lane order (the sort runs
// below the lock) and returns them: an UPDATE of a relay's lanes waits
// for them through it, so that it takes them in the order the outcome
// writes do (laneFence); an UPDATE's own scan takes them in the physical
// order of their row versions, and two statements whose snapshots
// straddle an UPDATE of a lane see two orders.
const lockOwnLanes = `SELECT k.lane FROM messaging_relay_lane k WHERE k.owner = $1 ORDER BY k.lane FOR NO KEY UPDATE`

// chargeOwed is the UPDATE that charges an attempt to each row of CTE owed
// (lane, s: a seq its lane's record listed, att: the attempts it had then)
// that is still as it was read: neither published nor parked, not under a
// per-row lease, with the same attempts. A row that spends the budget
// (budget, a parameter) is parked EXHAUSTED; detail is the failure detail,
// an SQL expression over h (owed). Used by a takeover and by SetLaneCount.
//
// The rows are found by seq, written with the claimable indexes' predicate
// so that a seq is a point probe of messaging_outbox_claimable_idx (the
// table has no other index on seq), and the seqs are given to the index as
// one array (seq = ANY): joined with the held record alone, the takeover's
// plan on a small table (TestLaneStatementsByIDUseNoClaimableIndex) read
// the whole index and filtered it, and a snapshot held open keeps an entry
// there for every row published since (see unclaimedByID).
func chargeOwed(budget, detail string) string {
	return `UPDATE messaging_outbox o
       SET attempts = o.attempts + 1,
           status = CASE WHEN o.attempts + 1 >= ` + budget + ` THEN 'EXHAUSTED' ELSE 'AMBIGUOUS' END,
           parked_at = CASE WHEN o.attempts + 1 >= ` + budget + ` THEN now() ELSE NULL END,
           next_attempt_at = NULL,
           last_attempt_at = now(),
           last_failure_code = '` + CodeLeaseExpired + `',
           last_failure_detail = ` + detail + `
      FROM owed h
     WHERE o.published_at IS NULL AND o.parked_at IS NULL AND o.status <> 'IN_FLIGHT'
       AND o.seq = ANY (ARRAY(SELECT w.s FROM owed w)) AND o.seq = h.s AND o.attempts = h.att`
}

// laneShareCTEs are the CTEs total (the table's lane count), live (the
// live polling relays, owner $1 counted whether or not its heartbeat is
// live, and how many of them sort before $1) and share (owner $1's fair
// share), for takeLanesSQL and laneShareSQL.
//
// The shares add up to the lane count: each relay has total / live lanes,
// and the first total % live of them by owner name one more. Every relay
// reads the same heartbeats, so each computes the same split. As
// ceil(total / live) for every relay, the shares added up to more lanes
// than there are: of three relays on 32 lanes one stayed a lane short, and
// of five one held 4 against the others' 7, each tried to take its missing
// lanes at every poll interval, and none was ever free.
const laneShareCTEs = `total AS (SELECT count(*)::int AS n FROM messaging_relay_lane),
live AS (
    SELECT count(*)::int AS n, count(*) FILTER (WHERE r.owner COLLATE "C" < $1 COLLATE "C")::int AS before
      FROM (SELECT owner FROM messaging_relay_heartbeat
             WHERE kind = 'POLLING' AND expires_at > now() AND owner <> $1
            UNION ALL SELECT $1) r
),
share AS (
    SELECT t.n / l.n + CASE WHEN l.before < t.n % l.n THEN 1 ELSE 0 END AS n FROM total t, live l
)`

// takeLanesSQL renews every lane of $1 (one statement per heartbeat), marks
// its heartbeat as a lane relay's, and takes unowned or expired lanes up to
// its fair share (laneShareCTEs: the lanes split evenly between the live
// polling relays), preferring unowned ones. Each lane taken gets a new
// epoch; the rows its expired owner held there and wrote no outcome for (the same attempts as recorded) are
// charged an attempt, and parked EXHAUSTED when that spends the budget $3.
var takeLanesSQL = `
WITH beat AS (
    UPDATE messaging_relay_heartbeat SET fence = 'LANES' WHERE owner = $1 AND fence IS DISTINCT FROM 'LANES'
),
` + laneShareCTEs + `,
renewed AS (
    UPDATE messaging_relay_lane
       SET lease_expires_at = now() + make_interval(secs => $2)
     WHERE owner = $1 AND lane IN (` + lockOwnLanes + `)
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
    SELECT d.lane, d.held_seqs, d.held_attempts
      FROM messaging_relay_lane_held d JOIN cand c ON c.lane = d.lane
     ORDER BY d.lane
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
       SET epoch = c.old_epoch + 1, held_seqs = '{}', held_attempts = '{}'
      FROM cand c
     WHERE d.lane = c.lane
),
owed AS MATERIALIZED (
    SELECT c.lane, c.old_owner, c.old_epoch, x.s, x.att
      FROM cand c JOIN held d ON d.lane = c.lane
     CROSS JOIN LATERAL unnest(d.held_seqs, d.held_attempts) AS x(s, att)
),
charged AS (
    ` + chargeOwed("$3", `'lane ' || h.lane || ' of ' || h.old_owner || ' (epoch ' || h.old_epoch
                                 || ') expired while it held this row; no outcome was written'`) + `
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
		return LaneState{}, noLanes(op)
	}
	slices.SortFunc(st.Owned, func(a, b LaneLease) int { return cmp.Compare(a.Lane, b.Lane) })
	return st, nil
}

const laneShareSQL = `WITH ` + laneShareCTEs + ` SELECT (SELECT n FROM share), (SELECT n FROM total)`

// LaneShare returns owner's fair share of the lanes now, as [TakeLanes]
// would take it (LaneState.Share, owner counted), and the
// lane count, writing nothing. A relay reads it between renewals to learn
// soon that relays joined or left: the relays already running give back
// or take lanes then, not at their next renewal.
func LaneShare(ctx context.Context, db DBTX, owner string) (share, total int, err error) {
	const op = "fencing.LaneShare"
	if owner == "" {
		return 0, 0, outbox.Errorf(CodeInvalidArgument, op, "owner must not be empty")
	}
	if err := db.QueryRowContext(ctx, laneShareSQL, owner).Scan(&share, &total); err != nil {
		return 0, 0, fmt.Errorf("%s: %w", op, err)
	}
	if total == 0 {
		return 0, 0, noLanes(op)
	}
	return share, total, nil
}

// giveBackSQL ends owner $1's lease on the lanes $2 (all of them when $2 is
// NULL): no owner, a new epoch, nothing held.
const giveBackSQL = `
WITH back AS (
    UPDATE messaging_relay_lane
       SET owner = NULL, lease_expires_at = NULL, epoch = epoch + 1, changed_at = now()
     WHERE owner = $1 AND ($2::int[] IS NULL OR lane = ANY ($2::int[])) AND lane IN (` + lockOwnLanes + `)
    RETURNING lane, epoch
),
cleared AS (
    UPDATE messaging_relay_lane_held d SET epoch = b.epoch, held_seqs = '{}', held_attempts = '{}'
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
	var only any // NULL: every lane of owner
	if lanes != nil {
		ls := make([]int64, len(lanes))
		for i, l := range lanes {
			ls[i] = int64(l)
		}
		only = pq.Array(ls)
	}
	rows, err := db.QueryContext(ctx, giveBackSQL, owner, only)
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
	if scheme == FenceLanes {
		var idx *string
		if err := db.QueryRowContext(ctx, `SELECT to_regclass('messaging_outbox_lane_idx')::text`).Scan(&idx); err != nil {
			return fmt.Errorf("%s: %w", op, err)
		}
		if idx == nil {
			return outbox.Errorf(CodeLanesMissing, op,
				"the lanes' index messaging_outbox_lane_idx does not exist: build it with `outboxctl lanes set 32` (fencing.SetLaneCount) before starting lane relays")
		}
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

// SetLaneCount sets the number of lanes to n and (re)builds the lanes'
// index, which a database needs before its first lane relay starts
// (migration 00050 creates the lanes, not the index: it would cost every
// insert of a fleet on per-row leases an index entry). It refuses with
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
		`WITH owed AS MATERIALIZED (
             SELECT l.lane, l.owner, x.s, x.att FROM messaging_relay_lane l
               JOIN messaging_relay_lane_held d ON d.lane = l.lane AND d.epoch = l.epoch
              CROSS JOIN LATERAL unnest(d.held_seqs, d.held_attempts) AS x(s, att)
              WHERE l.owner IS NOT NULL
         )
         ` + chargeOwed("$1", `'lane ' || h.lane || ' of ' || h.owner || ' expired while it held this row; no outcome was written'`),
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
