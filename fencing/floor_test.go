package fencing_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"hash/crc32"
	"testing"
	"time"

	"github.com/lib/pq"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// floorWait bounds how long a test waits for a floor to rise: the gate
// waits for every transaction of the database that started before a
// candidate. Each test has a database of its own (floorDB), so only its
// own transactions are there.
const floorWait = time.Minute

// floorDB is laneDB in a database of the test's own (testdb.Isolated):
// the floors' gate waits for every transaction of the database, and in the
// shared one other suites' long-open transactions held it back (the same
// tests of the pgx job among them: both failed, each waiting for the
// other's open transaction).
func floorDB(t *testing.T) *testdb.Schema {
	t.Helper()
	s := testdb.Isolated(t)
	require.NoError(t, fencing.SetLaneCount(context.Background(), s.DB, 32, 25))
	return s
}

// advanceUntil calls AdvanceLaneFloors for r's lanes until ok holds for
// the floors, and returns them. The floors rise only at a call after the
// one that recorded their candidates, once the transactions older than
// the candidates ended: the wait follows the floors, not a clock.
func (r *laneRelay) advanceUntil(t *testing.T, db *sql.DB, ok func(map[int]int64) bool) map[int]int64 {
	t.Helper()
	deadline := time.Now().Add(floorWait)
	for {
		_, err := fencing.AdvanceLaneFloors(context.Background(), db, r.owner, r.lanes(), r.state.Total)
		require.NoError(t, err)
		floors, err := fencing.LaneFloorsOf(context.Background(), db)
		require.NoError(t, err)
		if ok(floors) {
			return floors
		}
		require.False(t, time.Now().After(deadline), "floors did not reach the expected values: %v", floors)
		// Yield to the transactions the gate waits for; the loop's exit
		// is the floors' state above.
		time.Sleep(10 * time.Millisecond)
	}
}

// advance calls AdvanceLaneFloors n times for r's lanes and returns the
// floors after each call.
func (r *laneRelay) advance(t *testing.T, db *sql.DB, n int) []map[int]int64 {
	t.Helper()
	out := make([]map[int]int64, 0, n)
	for range n {
		_, err := fencing.AdvanceLaneFloors(context.Background(), db, r.owner, r.lanes(), r.state.Total)
		require.NoError(t, err)
		floors, err := fencing.LaneFloorsOf(context.Background(), db)
		require.NoError(t, err)
		out = append(out, floors)
	}
	return out
}

func allAtLeast(n int64) func(map[int]int64) bool {
	return func(f map[int]int64) bool {
		for _, v := range f {
			if v < n {
				return false
			}
		}
		return len(f) > 0
	}
}

func lastSeq(t *testing.T, db *sql.DB) int64 {
	t.Helper()
	var n int64
	require.NoError(t, db.QueryRow(`SELECT max(seq) FROM messaging_outbox`).Scan(&n))
	return n
}

func seqOf(t *testing.T, db *sql.DB, id string) int64 {
	t.Helper()
	var n int64
	require.NoError(t, db.QueryRow(`SELECT seq FROM messaging_outbox WHERE message_id = $1`, id).Scan(&n))
	return n
}

// unkeyedLane is the lane of an unkeyed row of seq in a table of n lanes.
func unkeyedLane(seq int64, n int) int { return int((seq >> 5) % int64(n)) }

// drain claims everything r can claim and writes PUBLISHED for it.
func (r *laneRelay) drain(t *testing.T, db *sql.DB) []string {
	t.Helper()
	var all []string
	for {
		got := r.claim(t, db, 5)
		if len(got) == 0 {
			return all
		}
		res, err := fencing.Apply(context.Background(), db, published(got))
		require.NoError(t, err)
		for _, x := range res {
			require.Equal(t, fencing.Applied, x)
		}
		r.held = nil
		all = append(all, ids(got)...)
	}
}

func insertUnkeyed(t *testing.T, db *sql.DB, prefix string, n int) {
	t.Helper()
	rows := make([]testdb.OutboxRow, n)
	for i := range rows {
		rows[i] = testdb.Row(envelope.Row{MessageID: fmt.Sprintf("%s%04d", prefix, i), Destination: "orders", Payload: []byte("p")})
	}
	testdb.InsertRows(t, db, rows...)
}

// claimBuffers is the shared buffers (hit and read) the claim p touches,
// from EXPLAIN (ANALYZE, BUFFERS) in a transaction rolled back.
func claimBuffers(t *testing.T, db *sql.DB, p fencing.ClaimParams, floorsAtZero bool) (buffers float64, claimed int) {
	t.Helper()
	q, args, err := fencing.ClaimStatement(p)
	require.NoError(t, err)
	tx, err := db.Begin()
	require.NoError(t, err)
	defer func() { _ = tx.Rollback() }()
	if floorsAtZero {
		_, err := tx.Exec(`UPDATE messaging_relay_lane SET floor_seq = 0`)
		require.NoError(t, err)
	}
	var js string
	require.NoError(t, tx.QueryRow("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) "+q, args...).Scan(&js))
	var plan []struct {
		Plan map[string]any `json:"Plan"`
	}
	require.NoError(t, json.Unmarshal([]byte(js), &plan))
	top := plan[0].Plan
	return top["Shared Hit Blocks"].(float64) + top["Shared Read Blocks"].(float64), int(top["Actual Rows"].(float64))
}

// A drained prefix is skipped by the claims of a new owner: the floors
// rise past it while a REPEATABLE READ snapshot is held (it has no
// transaction id, and it keeps the prefix's index entries alive), and a
// claim from the floors reads fewer buffers than the same claim from 0.
func TestLaneFloorsRiseUnderAHeldSnapshotAndANewOwnerStartsThere(t *testing.T) {
	s := floorDB(t)
	holder := s.Open(t)
	snap, err := holder.BeginTx(context.Background(), &sql.TxOptions{Isolation: sql.LevelRepeatableRead, ReadOnly: true})
	require.NoError(t, err)
	defer func() { _ = snap.Rollback() }()
	_, err = snap.Exec(`SELECT 1 FROM messaging_outbox LIMIT 1`)
	require.NoError(t, err)

	insertUnkeyed(t, s.DB, "a", 32*32*4) // four runs per lane
	a := takeLanes(t, s.DB, "a", time.Minute, 5)
	require.Len(t, a.drain(t, s.DB), 32*32*4)
	top := lastSeq(t, s.DB)
	floors := a.advanceUntil(t, s.DB, allAtLeast(top+1))
	for l, f := range floors {
		require.Equal(t, top+1, f, "lane %d: nothing is claimable below the identity's next value", l)
	}
	_, err = fencing.GiveBackLanes(context.Background(), s.DB, "a", nil)
	require.NoError(t, err)

	// A new owner, as a new relay process: the floors are the table's.
	insertUnkeyed(t, s.DB, "b", 64)
	b := takeLanes(t, s.DB, "b", time.Minute, 5)
	p := fencing.ClaimParams{Owner: "b", Limit: 1000, MaxAttempts: 5, Lanes: b.lanes(), LaneCount: b.state.Total, NoKeyWalk: true}
	fromFloor, n := claimBuffers(t, s.DB, p, false)
	require.Equal(t, 64, n)
	fromZero, n := claimBuffers(t, s.DB, p, true)
	require.Equal(t, 64, n)
	require.Less(t, fromFloor, fromZero, "a claim from the floors steps over the drained prefix")
	// The full statement (keys walked too) starts at the floors as well.
	p.NoKeyWalk = false
	fromFloorFull, n := claimBuffers(t, s.DB, p, false)
	require.Equal(t, 64, n)
	fromZeroFull, n := claimBuffers(t, s.DB, p, true)
	require.Equal(t, 64, n)
	require.Less(t, fromFloorFull, fromZeroFull)
	require.Len(t, b.drain(t, s.DB), 64)
	require.NoError(t, snap.Rollback())
}

// lateWriter is a transaction that draws a seq and has not committed:
// open starts it (and returns its backend's pid and the seq it drew),
// commit ends it.
type lateWriter struct {
	open   func(t *testing.T) (pid int, seq int64)
	commit func(t *testing.T)
}

// txKey names the transaction of backend pid as the floors' candidates
// record it ('pid/xact_start in microseconds since the epoch').
func txKey(t *testing.T, db *sql.DB, pid int) string {
	t.Helper()
	var k string
	require.NoError(t, db.QueryRow(`SELECT a.pid::text || '/' || (extract(epoch FROM a.xact_start) * 1000000)::bigint::text
		  FROM pg_stat_activity a WHERE a.pid = $1`, pid).Scan(&k))
	return k
}

// onlyBlocker reports whether the transaction key is the only one of the
// lane's candidate's waits still running: then a raise that does not
// happen was held back by it alone.
func onlyBlocker(t *testing.T, db *sql.DB, lane int, key string) bool {
	t.Helper()
	var waits []string
	require.NoError(t, db.QueryRow(`SELECT coalesce(floor_cand_wait, '{}') FROM messaging_relay_lane WHERE lane = $1`, lane).Scan(pq.Array(&waits)))
	require.Contains(t, waits, key, "the candidate names the open transaction")
	var others int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM pg_stat_activity a
		 WHERE a.pid::text || '/' || (extract(epoch FROM a.xact_start) * 1000000)::bigint::text = ANY ($1::text[])
		   AND a.pid::text || '/' || (extract(epoch FROM a.xact_start) * 1000000)::bigint::text <> $2`,
		pq.Array(waits), key).Scan(&others))
	return others == 0
}

// floorWaitsFor runs the scenario of a row whose seq was drawn by w before
// the rows after it, which the relay drains while w is open: the floors
// rise meanwhile (to the candidates taken before w began), never past
// w's seq while w is open (checked at three calls where w alone held the
// raise back), and w's row is claimed once w commits.
func floorWaitsFor(t *testing.T, s *testdb.Schema, w lateWriter) {
	insertUnkeyed(t, s.DB, "a", 64)
	a := takeLanes(t, s.DB, "a", time.Minute, 5)
	require.Len(t, a.drain(t, s.DB), 64)
	a.advance(t, s.DB, 1) // candidates: nothing below the next seq
	var cand int64
	require.NoError(t, s.DB.QueryRow(`SELECT min(floor_cand_seq) FROM messaging_relay_lane`).Scan(&cand))

	pid, lateSeq := w.open(t)
	key := txKey(t, s.DB, pid)
	lane := unkeyedLane(lateSeq, 32)
	insertUnkeyed(t, s.DB, "b", 32*32*2)
	require.Equal(t, 32*32*2, len(a.drain(t, s.DB))-s.Count(t, "message_id LIKE 'warm%'"))
	// The candidates taken before w began rise, though w is open.
	floors := a.advanceUntil(t, s.DB, allAtLeast(cand))
	require.Equal(t, cand, floors[lane])
	require.LessOrEqual(t, cand, lateSeq)

	// The next candidates were taken while w was open: w holds them.
	deadline := time.Now().Add(floorWait)
	for trials := 0; trials < 3; {
		alone := onlyBlocker(t, s.DB, lane, key)
		f := a.advance(t, s.DB, 1)[0]
		require.LessOrEqual(t, f[lane], lateSeq, "the floor of lane %d passed seq %d, drawn by a transaction still open", lane, lateSeq)
		if alone {
			trials++
		}
		require.False(t, time.Now().After(deadline), "other transactions of the database never let the gate be tried alone")
	}

	w.commit(t)
	require.Len(t, a.drain(t, s.DB), 1, "the row committed late is claimed")
	a.advanceUntil(t, s.DB, allAtLeast(lastSeq(t, s.DB)+1))
}

// A transaction that inserted a row (its seq drawn before the rows after
// it) and commits after the relay drained them and the floors rose: no
// floor passes the row while it is open, and it is delivered once it
// commits. The row is written by plain SQL.
func TestLaneFloorWaitsForALongOpenTransaction(t *testing.T) {
	s := floorDB(t)
	var late *sql.Tx
	floorWaitsFor(t, s, lateWriter{
		open: func(t *testing.T) (int, int64) {
			var err error
			late, err = s.Open(t).Begin()
			require.NoError(t, err)
			t.Cleanup(func() { _ = late.Rollback() })
			_, err = late.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload) VALUES ('late', 'orders', 'x')`)
			require.NoError(t, err)
			var pid int
			var seq int64
			require.NoError(t, late.QueryRow(`SELECT pg_backend_pid(), seq FROM messaging_outbox WHERE message_id = 'late'`).Scan(&pid, &seq))
			return pid, seq
		},
		commit: func(t *testing.T) { require.NoError(t, late.Commit()) },
	})
	require.Equal(t, "PUBLISHED", state(t, s.DB, "late").Status)
}

// A seq drawn before its transaction has an id: PostgreSQL evaluates the
// identity's nextval() before the heap insert assigns the transaction id,
// so a row can be in the middle of its INSERT (here held by a BEFORE
// trigger) with its seq drawn and no id. The floor does not pass it.
func TestLaneFloorWaitsForASeqDrawnBeforeItsTransactionID(t *testing.T) {
	s := floorDB(t)
	// The lock key and the row's id are this schema's own: make test runs
	// this test in two jobs at once against one database, and each must
	// find its own insert in pg_stat_activity and hold its own lock.
	key := int64(crc32.ChecksumIEEE([]byte(s.Name)))
	window := "window-" + s.Name
	for _, q := range []string{
		fmt.Sprintf(`CREATE FUNCTION floor_test_hold() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_advisory_xact_lock_shared(%d); RETURN NEW; END $$`, key),
		fmt.Sprintf(`CREATE TRIGGER floor_test_hold BEFORE INSERT ON messaging_outbox FOR EACH ROW
WHEN (NEW.message_id = '%s') EXECUTE FUNCTION floor_test_hold()`, window),
	} {
		_, err := s.DB.Exec(q)
		require.NoError(t, err)
	}
	locker, err := s.Open(t).Conn(context.Background())
	require.NoError(t, err)
	defer locker.Close()
	_, err = locker.ExecContext(context.Background(), `SELECT pg_advisory_lock($1)`, key)
	require.NoError(t, err)
	writer := s.Open(t)
	var done chan error
	floorWaitsFor(t, s, lateWriter{
		open: func(t *testing.T) (int, int64) {
			// nextval() gives the transaction an id itself when it
			// WAL-logs the sequence (every 32nd value, and the first
			// after a checkpoint): a committed row first, so the next
			// draw logs nothing; should a checkpoint come between, the
			// insert is cancelled and tried again.
			cancelled := []int64{} // backends of the tries cancelled: shown waiting a moment after
			for try := 0; ; try++ {
				require.Less(t, try, 5, "every try drew its seq with a transaction id")
				insertUnkeyed(t, s.DB, fmt.Sprintf("warm%d-", try), 1)
				done = make(chan error, 1)
				go func() {
					_, err := writer.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload) VALUES ($1, 'orders', 'x')`, window)
					done <- err
				}()
				// Wait until the insert waits in its trigger, its seq drawn.
				var pid int
				var xid sql.NullString
				deadline := time.Now().Add(floorWait)
				for {
					err := s.DB.QueryRow(`SELECT a.pid, a.backend_xid::text FROM pg_stat_activity a
						 WHERE a.wait_event_type = 'Lock' AND a.wait_event = 'advisory' AND a.query LIKE 'INSERT INTO messaging_outbox%'
						   AND a.pid <> ALL ($1::int8[]) AND a.pid IN (SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND objid = $2::bigint::oid)`, pq.Array(cancelled), key).Scan(&pid, &xid)
					if err == nil {
						break
					}
					require.ErrorIs(t, err, sql.ErrNoRows)
					require.False(t, time.Now().After(deadline), "the insert never reached its trigger")
					time.Sleep(5 * time.Millisecond)
				}
				if !xid.Valid {
					var seq int64 // drawn right after the warm row's
					require.NoError(t, s.DB.QueryRow(`SELECT seq + 1 FROM messaging_outbox WHERE message_id = $1`, fmt.Sprintf("warm%d-0000", try)).Scan(&seq))
					return pid, seq
				}
				_, err := s.DB.Exec(`SELECT pg_cancel_backend($1)`, pid)
				require.NoError(t, err)
				require.Error(t, <-done)
				cancelled = append(cancelled, int64(pid))
			}
		},
		commit: func(t *testing.T) {
			_, err := locker.ExecContext(context.Background(), `SELECT pg_advisory_unlock($1)`, key)
			require.NoError(t, err)
			require.NoError(t, <-done)
		},
	})
	require.Equal(t, "PUBLISHED", state(t, s.DB, window).Status)
}

// An AMBIGUOUS row waiting for its next attempt keeps its lane's floor at
// or below it, however far the rows after it were drained.
func TestLaneFloorStaysAtAnAmbiguousRowWaitingForItsRetry(t *testing.T) {
	s := floorDB(t)
	insertUnkeyed(t, s.DB, "a", 32*32*2)
	a := takeLanes(t, s.DB, "a", time.Minute, 5)
	got := a.claim(t, s.DB, 5)
	require.Len(t, got, 1000)
	var outs []fencing.Outcome
	var waiting fencing.Claimed
	for i, c := range got {
		if i == 40 {
			waiting = c
			outs = append(outs, fencing.Outcome{Lease: c.Lease, To: envelope.StatusAmbiguous, NextAttemptAt: time.Now().Add(time.Hour), Code: "TIMEOUT"})
			continue
		}
		outs = append(outs, fencing.Outcome{Lease: c.Lease, To: envelope.StatusPublished})
	}
	_, err := fencing.Apply(context.Background(), s.DB, outs)
	require.NoError(t, err)
	a.held = nil
	a.drain(t, s.DB)
	seq := waiting.Row.Seq
	lane := unkeyedLane(seq, 32)
	floors := a.advanceUntil(t, s.DB, func(f map[int]int64) bool {
		for l, v := range f {
			if l != lane && v <= lastSeq(t, s.DB) {
				return false
			}
		}
		return true
	})
	require.Equal(t, seq, floors[lane], "the floor stops at the row waiting for its retry")
	for _, f := range a.advance(t, s.DB, 3) {
		require.Equal(t, seq, f[lane])
	}
	p := fencing.ClaimParams{Owner: "a", Limit: 10, MaxAttempts: 5, Lanes: a.lanes(), LaneCount: 32, Now: time.Now().Add(2 * time.Hour)}
	due, err := fencing.Claim(context.Background(), s.DB, p)
	require.NoError(t, err)
	require.Equal(t, []string{waiting.Row.MessageID}, ids(due), "once due, the row is claimed")
}

// Changing the lane count resets every floor.
func TestLaneCountChangeResetsTheFloors(t *testing.T) {
	s := floorDB(t)
	insertUnkeyed(t, s.DB, "a", 100)
	a := takeLanes(t, s.DB, "a", time.Minute, 5)
	a.drain(t, s.DB)
	a.advanceUntil(t, s.DB, allAtLeast(lastSeq(t, s.DB)+1))
	_, err := fencing.GiveBackLanes(context.Background(), s.DB, "a", nil)
	require.NoError(t, err)
	require.NoError(t, fencing.SetLaneCount(context.Background(), s.DB, 16, 5))
	floors, err := fencing.LaneFloorsOf(context.Background(), s.DB)
	require.NoError(t, err)
	require.Len(t, floors, 16)
	for l, f := range floors {
		require.Zero(t, f, "lane %d", l)
	}
	require.Zero(t, testdb.QueryInt(t, s.DB, `SELECT count(*) FROM messaging_relay_lane WHERE floor_cand_seq IS NOT NULL OR floor_cand_at IS NOT NULL`))
}

// A relay's floors are only its own lanes', and only a live owner's.
func TestAdvanceLaneFloorsTouchesOnlyTheOwnersLanes(t *testing.T) {
	s := floorDB(t)
	insertUnkeyed(t, s.DB, "a", 64)
	a := takeLanes(t, s.DB, "a", time.Minute, 5)
	a.drain(t, s.DB)
	_, err := fencing.AdvanceLaneFloors(context.Background(), s.DB, "nobody", a.lanes(), 32)
	require.NoError(t, err)
	require.Zero(t, testdb.QueryInt(t, s.DB, `SELECT count(*) FROM messaging_relay_lane WHERE floor_cand_seq IS NOT NULL OR floor_seq <> 0`))
	_, err = fencing.AdvanceLaneFloors(context.Background(), s.DB, "", a.lanes(), 32)
	require.ErrorIs(t, err, fencing.ErrInvalidArgument)
	_, err = fencing.AdvanceLaneFloors(context.Background(), s.DB, "a", []int{32}, 32)
	require.ErrorIs(t, err, fencing.ErrInvalidArgument)
}

// A relay whose login may not read other roles' sessions cannot tell
// whether a transaction older than a candidate still runs: its floors
// stay; with pg_read_all_stats they rise.
func TestLaneFloorsNeedToSeeEverySession(t *testing.T) {
	s := floorDB(t)
	insertUnkeyed(t, s.DB, "a", 64)
	a := takeLanes(t, s.DB, "a", time.Minute, 5)
	a.drain(t, s.DB)
	name, url := s.Role(t,
		"GRANT SELECT, UPDATE ON messaging_relay_lane TO %[1]s",
		"GRANT SELECT ON messaging_outbox TO %[1]s",
		"GRANT SELECT ON ALL SEQUENCES IN SCHEMA "+s.Name+" TO %[1]s")
	relay, err := testdb.OpenURL(url)
	require.NoError(t, err)
	defer relay.Close()
	// A session of another role in this database: the test's own pool.
	conn, err := s.DB.Conn(context.Background())
	require.NoError(t, err)
	defer conn.Close()
	for range 3 {
		_, err := fencing.AdvanceLaneFloors(context.Background(), relay, "a", a.lanes(), 32)
		require.NoError(t, err)
	}
	require.Zero(t, testdb.QueryInt(t, s.DB, `SELECT count(*) FROM messaging_relay_lane WHERE floor_seq <> 0`),
		"sessions it cannot see hold the floors")
	_, err = s.DB.Exec("GRANT pg_read_all_stats TO " + name)
	require.NoError(t, err)
	a.advanceUntil(t, relay, allAtLeast(lastSeq(t, s.DB)+1))
}
