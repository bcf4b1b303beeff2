// Lane floors (migration 00052): the seq below which a lane has no
// claimable unkeyed row, persisted so that every claim of the lane, by any
// relay, starts its descent of messaging_outbox_lane_idx there.

package fencing

import (
	"context"
	"database/sql"
	"fmt"

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
// committed. AdvanceLaneFloors raises in two calls. The first records a
// candidate C (the lane's first row neither published nor parked at or
// above the floor, as its snapshot sees it; with none, the identity's last
// value + 1) and the server's clock t0 after both were read. Every seq
// below C was drawn before t0: the identity's CACHE is 1 (refused
// otherwise), so seqs are handed out in time order, and C's row was
// visible, or C - 1 had been handed out, before t0. So the transaction T of
// any row below C that is not yet committed started before t0
// (pg_stat_activity.xact_start <= t0). A later call raises the floor to C
// only when no transaction of this database that started at or before t0
// is still running with a transaction id, or in a statement (state not
// idle in transaction), and no prepared transaction of the database
// exists. The statement clause matters: PostgreSQL evaluates the seq's
// default (nextval) before the heap insert assigns the transaction its id,
// so at t0 T may hold its seq with no id (in the middle of its INSERT, for
// as long as a BEFORE ROW trigger of the application runs); it is then in
// a statement, and after the insert it has an id. A transaction idle in
// transaction without an id inserted nothing (a statement that drew a seq
// and failed or inserted nothing leaves no row). Then, in a later
// statement of the same transaction (a snapshot taken after that test, so
// every such T's row is visible), the floor becomes least(C, the first row
// neither published nor parked at or above the old floor): a recheck of
// [old floor, C) once per candidate, not per claim. The lane rows are
// locked (in lane order) before that snapshot, so a redrive racing the
// raise either committed before it (its row is seen) or lowers the floor
// after it.
//
// A read-only transaction holding a snapshot (REPEATABLE READ) has no
// transaction id and is idle in transaction between its statements: it
// does not hold floors back, while the dead index entries it keeps are
// what the floors let the claims skip.
//
// What it cannot see, and then keeps the floor where it is (correct,
// only slower): sessions of other roles whose activity the relay's login
// may not read (grant it pg_read_all_stats) hold every floor, as does a
// prepared transaction of the database. Not covered: a row inserted with
// an explicit seq (OVERRIDING SYSTEM VALUE) below a lane's floor, or from
// a nextval() drawn in an earlier statement, or an identity restarted
// lower; lower the floor by hand, or set the lane count again, after such
// an insert. A server clock that
// steps back across t0 could also let a raise pass a transaction started
// just before it: the test keeps a margin of floorClockSlack.

// floorGateSQL locks the lanes $2 of owner $1 (in lane order, as every
// statement that locks lanes does) and returns for each whether its
// candidate is ripe (may become its floor now) or missing, and the
// identity's last value (read before the candidate statement's clock).
const floorGateSQL = `
WITH act AS MATERIALIZED (
    SELECT a.xact_start, a.query = '<insufficient privilege>' AS hidden
      FROM pg_stat_activity a
     WHERE a.datid = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())
       AND a.pid <> pg_backend_pid()
       -- NULL for a session the login may not see (hidden below)
       AND coalesce(a.backend_type NOT IN ('autovacuum worker', 'walsender'), true)
       AND (a.query = '<insufficient privilege>'
            OR (a.xact_start IS NOT NULL
                AND (a.backend_xid IS NOT NULL OR a.state NOT IN ('idle in transaction', 'idle in transaction (aborted)'))))
),
seqid AS (SELECT pg_get_serial_sequence('messaging_outbox', 'seq')::regclass AS id),
gate AS (
    SELECT NOT EXISTS (SELECT 1 FROM act WHERE hidden)
       AND NOT EXISTS (SELECT 1 FROM pg_prepared_xacts p WHERE p.database = current_database())
       AND coalesce((SELECT s.seqcache = 1 FROM pg_sequence s WHERE s.seqrelid = (SELECT id FROM seqid)), false) AS open,
       (SELECT min(a.xact_start) FROM act a WHERE NOT a.hidden) AS oldest,
       coalesce(pg_sequence_last_value((SELECT id FROM seqid)), 0) AS last
)
SELECT l.lane, l.floor_cand_seq IS NOT NULL AND g.open
           AND (g.oldest IS NULL OR g.oldest > l.floor_cand_at + make_interval(secs => $3)) AS ripe,
       l.floor_cand_seq IS NULL AS missing, g.last
  FROM messaging_relay_lane l CROSS JOIN gate g
 WHERE l.lane = ANY ($2::int[]) AND l.owner = $1
 ORDER BY l.lane
   FOR NO KEY UPDATE OF l`

// floorRaiseSQL raises the floor of each ripe lane of $1 ($2 true) to
// least(candidate, first row neither published nor parked at or above the
// old floor), and records a new candidate for each (the first such row,
// else the identity's last value $3 + 1) with the clock read after this
// statement's snapshot. Lanes whose floor and candidate stay are not
// written. The lanes were locked by floorGateSQL in the same transaction.
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
           coalesce(f.first, $3::int8 + 1) AS new_cand
      FROM f
)
UPDATE messaging_relay_lane l
   SET floor_seq = n.new_floor, floor_cand_seq = n.new_cand, floor_cand_at = clock_timestamp()
  FROM n
 WHERE l.lane = n.lane AND (n.new_floor <> n.floor_seq OR n.new_cand IS DISTINCT FROM n.floor_cand_seq)
RETURNING l.lane, l.floor_seq, n.floor_seq`
}

// floorClockSlack is how far a transaction may have started after a
// candidate's clock and still hold its raise back: a margin for a server
// clock stepped back, in seconds.
const floorClockSlack = 1.0

// LaneFloors is what [AdvanceLaneFloors] did.
type LaneFloors struct {
	Raised  map[int]int64 // lanes whose floor rose, and to what
	Written int           // lanes whose floor or candidate was written
}

// AdvanceLaneFloors raises the floors of owner's lanes (those of lanes it
// owns) where it is safe, and records new candidates (see "Why a floor
// is safe" above). It takes
// two statements in one transaction of db, locks the lanes (an outcome
// write of the owner waits for it, briefly) and descends each lane's index
// once from its floor. A relay calls it from time to time; it changes
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
	rows, err := tx.QueryContext(ctx, floorGateSQL, owner, pq.Array(ls), floorClockSlack)
	if err != nil {
		return LaneFloors{}, fmt.Errorf("%s: %w", op, err)
	}
	var due []int64
	var ripe []bool
	var last int64
	for rows.Next() {
		var lane int64
		var r, missing bool
		if err := rows.Scan(&lane, &r, &missing, &last); err != nil {
			rows.Close()
			return LaneFloors{}, fmt.Errorf("%s: %w", op, err)
		}
		if r || missing {
			due, ripe = append(due, lane), append(ripe, r)
		}
	}
	if err := rows.Close(); err != nil {
		return LaneFloors{}, fmt.Errorf("%s: %w", op, err)
	}
	if err := rows.Err(); err != nil {
		return LaneFloors{}, fmt.Errorf("%s: %w", op, err)
	}
	var out LaneFloors
	if len(due) > 0 {
		rows, err := tx.QueryContext(ctx, floorRaiseSQL(laneCount), pq.Array(due), pq.Array(ripe), last)
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
