// Lane floors (migration 00052): the seq below which a lane has no
// claimable unkeyed row, persisted so that every claim of the lane, by any
// relay, starts its descent of messaging_outbox_lane_idx there.

package fencing

import (
	"context"
	"database/sql"
	"fmt"
	"slices"

	"github.com/lib/pq"

	outbox "github.com/fencedoutbox/watermill-outbox"
)

// Why a floor is safe.
//
// Invariant: every committed unkeyed row of lane l that is neither
// published nor parked has seq >= floor_seq(l). The claims then lose
// nothing by descending from greatest(FromSeq, floor_seq) (claim_sql.go,
// lane_claim.go).
//
// A row changes "published or parked" back to neither only through a
// redrive (journal), which lowers the floor of the row's lane in the same
// transaction (least(floor_seq, seq), evaluated on the lane row's newest
// version, so it holds against a raise that commits first). No other
// statement of the project clears published_at or parked_at; an operator's
// hand-written UPDATE that does must lower the floor too (or run
// `outboxctl lanes set N`, which resets every floor to 0). A takeover's
// charges and the outcomes move rows that are neither to a state that is
// neither or parked: the invariant holds for them unchanged.
//
// The hard part is a row that commits late below a floor raised
// meanwhile: a transaction that drew its seq from the identity and has not
// committed. AdvanceLaneFloors raises in two calls, each one transaction
// of three statements. The first statement locks the lanes (in lane order,
// as every statement that locks lanes does) and reads the identity's last
// value L. The second reads pg_stat_activity (its first read in the
// transaction: PostgreSQL then keeps that picture until the transaction
// ends), which happens after every seq up to L was handed out. The third
// records, per lane, a candidate C = least(the lane's first row neither
// published nor parked at or above the floor, as its snapshot sees it,
// L + 1), with the transactions the second statement saw in progress that
// could still commit a row: those with a transaction id, and those in a
// statement (state not idle in transaction), each named by its backend's
// pid and its xact_start. Every seq below C is at most L (the identity's
// CACHE is 1, checked: a session holds no values it drew earlier), so the
// transaction T of any row below C not yet committed was in progress at
// that read, and is named there. A later call raises the floor to C only
// when none of the named transactions still runs (same pid, same
// xact_start: equality, so no clock is compared) and no prepared
// transaction of the database exists.
//
// "In a statement" matters: PostgreSQL evaluates the seq's default
// (nextval) before the heap insert assigns the transaction its id
// (nextval assigns one itself only when it WAL-logs the sequence: every
// 32nd value, and the first after a checkpoint), so T may hold its seq
// with no id, in the middle of its INSERT (for as long as a BEFORE ROW
// trigger of the application runs): no snapshot's xip lists it, and a
// rule on transaction ids alone would let the floor pass its row. It is
// then in a statement; after the insert it has an id. A transaction idle
// in transaction without an id inserted nothing (a statement that drew a
// seq and failed or inserted nothing leaves no row).
//
// Then, in the raising call's third statement (its snapshot is taken
// after the second statement found the named transactions ended, so their
// rows are visible), the floor becomes least(C, the first row neither
// published nor parked at or above the old floor): a recheck of
// [old floor, C) once per candidate, not per claim. The lanes are locked
// before that snapshot, so a redrive racing the raise either committed
// before it (its row is seen) or lowers the floor after it.
//
// A read-only transaction holding a snapshot (REPEATABLE READ) has no
// transaction id and is idle in transaction between its statements: it is
// not named, and does not hold floors back, while the dead index entries
// it keeps are what the floors let the claims skip. Transactions that
// begin after a candidate never hold it back.
//
// What it cannot see, and then records nothing and raises nothing
// (correct, only slower): sessions of other roles whose activity the
// relay's login may not read (grant it pg_read_all_stats), a prepared
// transaction of the database, an identity whose CACHE is above 1. Not
// covered: a row inserted with an explicit seq (OVERRIDING SYSTEM VALUE)
// below a lane's floor, or from a nextval() drawn in an earlier statement,
// or an identity restarted lower; lower the floor by hand, or set the lane
// count again, after such an insert.

// floorLockSQL locks the lanes $2 of owner $1 in lane order and returns
// each one's candidate (NULL: none) and the transactions it waits for,
// with the identity's last value (read before floorGateSQL reads the
// sessions).
const floorLockSQL = `
WITH last AS (
    SELECT coalesce(pg_sequence_last_value(pg_get_serial_sequence('messaging_outbox', 'seq')::regclass), 0) AS v
)
SELECT l.lane, l.floor_cand_seq IS NULL, coalesce(l.floor_cand_wait, '{}'), (SELECT v FROM last)
  FROM messaging_relay_lane l
 WHERE l.lane = ANY ($2::int[]) AND l.owner = $1
 ORDER BY l.lane
   FOR NO KEY UPDATE OF l`

// floorGateSQL reads the sessions of this database (not this one): whether
// floors may be judged at all (every session visible, no prepared
// transaction, the identity's CACHE 1), every transaction in progress, and
// those of them that may still commit a row (with an id, or in a
// statement), each as 'pid/xact_start in microseconds since the epoch'.
const floorGateSQL = `
WITH act AS MATERIALIZED (
    SELECT a.query = '<insufficient privilege>' AS hidden,
           a.pid::text || '/' || (extract(epoch FROM a.xact_start) * 1000000)::bigint::text AS tx,
           a.backend_xid IS NOT NULL OR a.state NOT IN ('idle in transaction', 'idle in transaction (aborted)') AS writes
      FROM pg_stat_activity a
     WHERE a.datid = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())
       AND a.pid <> pg_backend_pid()
       -- NULL for a session the login may not see (hidden)
       AND coalesce(a.backend_type NOT IN ('autovacuum worker', 'walsender'), true)
       AND (a.xact_start IS NOT NULL OR a.query = '<insufficient privilege>')
)
SELECT NOT EXISTS (SELECT 1 FROM act WHERE hidden)
       AND NOT EXISTS (SELECT 1 FROM pg_prepared_xacts p WHERE p.database = current_database())
       AND coalesce((SELECT s.seqcache = 1 FROM pg_sequence s
                      WHERE s.seqrelid = pg_get_serial_sequence('messaging_outbox', 'seq')::regclass), false),
       coalesce((SELECT array_agg(tx) FROM act WHERE NOT hidden), '{}'),
       coalesce((SELECT array_agg(tx) FROM act WHERE NOT hidden AND writes), '{}')`

// floorRaiseSQL raises the floor of each ripe lane of $1 ($2 true) to
// least(candidate, first row neither published nor parked at or above the
// old floor), and records a new candidate for each (the first such row,
// at most the identity's last value $3 + 1) with the transactions $4 it
// waits for. Lanes whose floor and candidate stay are not written. The
// lanes were locked by floorLockSQL in the same transaction.
func floorRaiseSQL(lanes int) string {
	return `
WITH f AS MATERIALIZED (
    SELECT l.lane, l.floor_seq, l.floor_cand_seq, r.ripe,
           (SELECT o.seq FROM messaging_outbox o
             WHERE ` + unkeyedLaneExpr("o", lanes) + ` = l.lane
               AND o.ordering_key IS NULL AND o.published_at IS NULL AND o.parked_at IS NULL AND o.seq >= l.floor_seq
             ORDER BY o.seq
             LIMIT 1) AS first
      FROM unnest($1::int[], $2::bool[]) AS r(lane, ripe) JOIN messaging_relay_lane l ON l.lane = r.lane
),
n AS (
    SELECT f.lane, f.floor_seq, f.floor_cand_seq,
           CASE WHEN f.ripe THEN least(f.floor_cand_seq, coalesce(f.first, f.floor_cand_seq)) ELSE f.floor_seq END AS new_floor,
           least(f.first, $3::int8 + 1) AS new_cand
      FROM f
)
UPDATE messaging_relay_lane l
   SET floor_seq = n.new_floor, floor_cand_seq = n.new_cand, floor_cand_at = now(), floor_cand_wait = $4::text[]
  FROM n
 WHERE l.lane = n.lane AND (n.new_floor <> n.floor_seq OR n.new_cand IS DISTINCT FROM n.floor_cand_seq)
RETURNING l.lane, l.floor_seq, n.floor_seq`
}

// LaneFloors is what [AdvanceLaneFloors] did.
type LaneFloors struct {
	Raised  map[int]int64 // lanes whose floor rose, and to what
	Written int           // lanes whose floor or candidate was written
}

// AdvanceLaneFloors raises the floors of owner's lanes (those of lanes it
// owns) where it is safe, and records new candidates (see "Why a floor
// is safe" above). It takes three statements in one transaction of db,
// locks the lanes (an outcome write of the owner waits for it, briefly)
// and descends each lane's index once from its floor where a candidate
// is due. A relay calls it from time to time; it changes
// nothing a claim relies on, so a failed call only leaves the floors where
// they were.
func AdvanceLaneFloors(ctx context.Context, db *sql.DB, owner string, lanes []int, laneCount int) (LaneFloors, error) {
	const op = "fencing.AdvanceLaneFloors"
	if owner == "" {
		return LaneFloors{}, outbox.Errorf(CodeInvalidArgument, op, "owner must not be empty")
	}
	if err := checkLaneParams(op, ClaimParams{Lanes: lanes, LaneCount: laneCount}); err != nil {
		return LaneFloors{}, err
	}
	ls := make([]int64, len(lanes))
	for i, l := range lanes {
		ls[i] = int64(l)
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return LaneFloors{}, fmt.Errorf("%s: %w", op, err)
	}
	defer tx.Rollback() //nolint:errcheck // after Commit a no-op
	type lane struct {
		lane    int64
		missing bool
		waits   []string
	}
	var locked []lane
	var last int64
	rows, err := tx.QueryContext(ctx, floorLockSQL, owner, pq.Array(ls))
	if err != nil {
		return LaneFloors{}, fmt.Errorf("%s: %w", op, err)
	}
	for rows.Next() {
		var l lane
		if err := rows.Scan(&l.lane, &l.missing, pq.Array(&l.waits), &last); err != nil {
			rows.Close()
			return LaneFloors{}, fmt.Errorf("%s: %w", op, err)
		}
		locked = append(locked, l)
	}
	if err := rows.Close(); err != nil {
		return LaneFloors{}, fmt.Errorf("%s: %w", op, err)
	}
	if err := rows.Err(); err != nil {
		return LaneFloors{}, fmt.Errorf("%s: %w", op, err)
	}
	if len(locked) == 0 {
		return LaneFloors{}, nil
	}
	var open bool
	var running, writing []string
	if err := tx.QueryRowContext(ctx, floorGateSQL).Scan(&open, pq.Array(&running), pq.Array(&writing)); err != nil {
		return LaneFloors{}, fmt.Errorf("%s: %w", op, err)
	}
	if !open {
		// Sessions it cannot see (or a prepared transaction, or an
		// identity that caches values): no candidate can be judged, nor
		// recorded with what it waits for.
		return LaneFloors{}, nil
	}
	live := make(map[string]bool, len(running))
	for _, x := range running {
		live[x] = true
	}
	var due []int64
	var ripe []bool
	for _, l := range locked {
		r := !l.missing && !slices.ContainsFunc(l.waits, func(w string) bool { return live[w] })
		if r || l.missing {
			due, ripe = append(due, l.lane), append(ripe, r)
		}
	}
	var out LaneFloors
	if len(due) > 0 {
		rows, err := tx.QueryContext(ctx, floorRaiseSQL(laneCount), pq.Array(due), pq.Array(ripe), last, pq.Array(writing))
		if err != nil {
			return LaneFloors{}, fmt.Errorf("%s: %w", op, err)
		}
		before := make(map[int]bool, len(due)) // lane -> ripe
		for i, l := range due {
			before[int(l)] = ripe[i]
		}
		for rows.Next() {
			var lane int
			var floor, old int64
			if err := rows.Scan(&lane, &floor, &old); err != nil {
				rows.Close()
				return LaneFloors{}, fmt.Errorf("%s: %w", op, err)
			}
			out.Written++
			if before[lane] && floor > old {
				if out.Raised == nil {
					out.Raised = make(map[int]int64)
				}
				out.Raised[lane] = floor
			}
		}
		if err := rows.Err(); err != nil {
			return LaneFloors{}, fmt.Errorf("%s: %w", op, err)
		}
	}
	if err := tx.Commit(); err != nil {
		return LaneFloors{}, fmt.Errorf("%s: %w", op, err)
	}
	return out, nil
}

// LaneFloorsOf returns the floor of every lane.
func LaneFloorsOf(ctx context.Context, db DBTX) (map[int]int64, error) {
	rows, err := db.QueryContext(ctx, `SELECT lane, floor_seq FROM messaging_relay_lane`)
	if err != nil {
		return nil, fmt.Errorf("fencing.LaneFloorsOf: %w", err)
	}
	defer rows.Close()
	out := make(map[int]int64)
	for rows.Next() {
		var l int
		var f int64
		if err := rows.Scan(&l, &f); err != nil {
			return nil, fmt.Errorf("fencing.LaneFloorsOf: %w", err)
		}
		out[l] = f
	}
	return out, rows.Err()
}
