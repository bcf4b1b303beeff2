package fencing_test

import (
	"context"
	"database/sql"
	"fmt"
	"testing"
	"time"

	"github.com/lib/pq"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// laneRelay is one relay of the lane scheme in a test: its owner, the
// lanes it took and the rows it holds.
type laneRelay struct {
	owner string
	state fencing.LaneState
	held  []int64 // seqs
}

// laneDB is a test schema whose lanes' index is built (32 lanes), as
// `outboxctl lanes set 32` builds it.
func laneDB(t *testing.T) *testdb.Schema {
	t.Helper()
	s := newDB(t)
	require.NoError(t, fencing.SetLaneCount(context.Background(), s.DB, 32, 25))
	return s
}

func takeLanes(t *testing.T, db fencing.DBTX, owner string, ttl time.Duration, budget int) *laneRelay {
	t.Helper()
	st, err := fencing.TakeLanes(context.Background(), db, fencing.LaneParams{Owner: owner, TTL: ttl, MaxAttempts: budget})
	require.NoError(t, err)
	return &laneRelay{owner: owner, state: st}
}

func (r *laneRelay) lanes() []int {
	ls := make([]int, len(r.state.Owned))
	for i, l := range r.state.Owned {
		ls[i] = l.Lane
	}
	return ls
}

func (r *laneRelay) claim(t *testing.T, db fencing.DBTX, budget int) []fencing.Claimed {
	t.Helper()
	p := fencing.ClaimParams{Owner: r.owner, Limit: 1000, MaxAttempts: budget,
		Lanes: r.lanes(), LaneCount: r.state.Total, HeldSeqs: r.held}
	got, err := fencing.Claim(context.Background(), db, p)
	require.NoError(t, err)
	for _, c := range got {
		if c.Held() {
			r.held = append(r.held, c.Row.Seq)
		}
	}
	return got
}

func published(cs []fencing.Claimed) []fencing.Outcome {
	out := make([]fencing.Outcome, 0, len(cs))
	for _, c := range cs {
		if c.Held() {
			out = append(out, fencing.Outcome{Lease: c.Lease, To: envelope.StatusPublished})
		}
	}
	return out
}

func xmin(t *testing.T, db *sql.DB, id string) string {
	t.Helper()
	var x string
	require.NoError(t, db.QueryRow(`SELECT xmin::text || ctid::text FROM messaging_outbox WHERE message_id = $1`, id).Scan(&x))
	return x
}

// A lane claim reads rows without writing them; the outcome is the row's
// one new version, and records the relay and the lane's epoch.
func TestLaneClaimWritesNothingAndTheOutcomeIsTheOnlyWrite(t *testing.T) {
	s := laneDB(t)
	for i := range 20 {
		insert(t, s.DB, fmt.Sprintf("u%02d", i), "")
		insert(t, s.DB, fmt.Sprintf("k%02d", i), fmt.Sprintf("key-%d", i%4))
	}
	require.NoError(t, fencing.EnterFence(context.Background(), s.DB, "a", fencing.FenceLanes))
	a := takeLanes(t, s.DB, "a", time.Minute, 5)
	require.Len(t, a.state.Owned, 32, "one live relay takes every lane")
	before := xmin(t, s.DB, "u00")

	got := a.claim(t, s.DB, 5)
	require.Len(t, got, 40)
	require.Equal(t, before, xmin(t, s.DB, "u00"), "the claim wrote no new row version")
	require.Equal(t, 40, s.Count(t, "status = 'PENDING'"))
	var held int
	require.NoError(t, s.DB.QueryRow(`SELECT sum(cardinality(d.held_seqs)) FROM messaging_relay_lane_held d JOIN messaging_relay_lane l USING (lane) WHERE l.owner = 'a' AND d.epoch = l.epoch`).Scan(&held))
	require.Equal(t, 40, held, "the lanes record what their owner holds")

	again := a.claim(t, s.DB, 5)
	require.Empty(t, again, "held rows are not claimed again")

	res, err := fencing.Apply(context.Background(), s.DB, published(got))
	require.NoError(t, err)
	for _, r := range res {
		require.Equal(t, fencing.Applied, r)
	}
	st := state(t, s.DB, "k05")
	require.Equal(t, "PUBLISHED", st.Status)
	require.Equal(t, 1, st.Attempts)
	require.Equal(t, "a", st.Owner)
	require.Positive(t, st.Token)
}

// A key's rows come out in seq order, one chain at a time: the next row of
// a key is not claimed while an earlier one is held, unless it continues it.
func TestLaneClaimKeepsAKeysOrder(t *testing.T) {
	s := laneDB(t)
	for i := range 6 {
		insert(t, s.DB, fmt.Sprintf("k%d", i), "hot")
	}
	a := takeLanes(t, s.DB, "a", time.Minute, 5)
	p := fencing.ClaimParams{Owner: "a", Limit: 3, MaxChain: 3, MaxAttempts: 5, Lanes: a.lanes(), LaneCount: a.state.Total}
	first, err := fencing.Claim(context.Background(), s.DB, p)
	require.NoError(t, err)
	require.Equal(t, []string{"k0", "k1", "k2"}, ids(first))
	p.Held = ids(first)
	blocked, err := fencing.Claim(context.Background(), s.DB, p)
	require.NoError(t, err)
	require.Empty(t, blocked, "the key's head is held: its later rows wait")
	p.Continue = []fencing.Continuation{{Key: "hot", AfterSeq: first[2].Row.Seq, AfterID: "k2"}}
	next, err := fencing.Claim(context.Background(), s.DB, p)
	require.NoError(t, err)
	require.Equal(t, []string{"k3", "k4", "k5"}, ids(next), "a continuation follows a held row")
}

// A relay whose lane was taken while it published writes nothing and is
// told stale; the new owner charges the attempt and delivers the row under
// the same message id.
func TestTakenLaneFencesItsFormerOwner(t *testing.T) {
	s := laneDB(t)
	insert(t, s.DB, "m1", "order-1")
	a := takeLanes(t, s.DB, "a", time.Minute, 5)
	got := a.claim(t, s.DB, 5)
	require.Len(t, got, 1)
	expireLanes(t, s.DB, "a")

	b := takeLanes(t, s.DB, "b", time.Minute, 5)
	require.Len(t, b.state.Owned, 32)
	require.Equal(t, 1, b.state.Charged, "the row a held without an outcome is charged")

	res, err := fencing.Apply(context.Background(), s.DB, published(got))
	require.NoError(t, err)
	require.Equal(t, []fencing.Result{fencing.Stale}, res)
	st := state(t, s.DB, "m1")
	require.Equal(t, "AMBIGUOUS", st.Status)
	require.Equal(t, 1, st.Attempts)
	require.Equal(t, fencing.CodeLeaseExpired, st.Code)

	again := b.claim(t, s.DB, 5)
	require.Equal(t, []string{"m1"}, ids(again))
	res, err = fencing.Apply(context.Background(), s.DB, published(again))
	require.NoError(t, err)
	require.Equal(t, []fencing.Result{fencing.Applied}, res)
	st = state(t, s.DB, "m1")
	require.Equal(t, "PUBLISHED", st.Status)
	require.Equal(t, 2, st.Attempts)
	require.Equal(t, "b", st.Owner)
}

// expireLanes ends owner's lane leases as if it had died: no renewal came
// before they ran out.
func expireLanes(t *testing.T, db *sql.DB, owner string) {
	t.Helper()
	res, err := db.Exec(`UPDATE messaging_relay_lane SET lease_expires_at = now() - interval '1 second' WHERE owner = $1`, owner)
	require.NoError(t, err)
	n, err := res.RowsAffected()
	require.NoError(t, err)
	require.Positive(t, n)
}

// A takeover racing an outcome write ends with exactly one of them
// applied. The outcome holds its lanes FOR SHARE until it commits: a
// takeover meanwhile skips the lane (and takes it after, charging nothing,
// since the row has its outcome). A takeover that holds the lane first
// makes the outcome wait, and the outcome then finds the lane changed.
func TestTakeoverRacingAnOutcomeAppliesExactlyOne(t *testing.T) {
	ctx := context.Background()
	take := func(db fencing.DBTX) fencing.LaneState {
		st, err := fencing.TakeLanes(ctx, db, fencing.LaneParams{Owner: "b", TTL: time.Minute, MaxAttempts: 5})
		require.NoError(t, err)
		return st
	}
	t.Run("outcome first", func(t *testing.T) {
		s := laneDB(t)
		insert(t, s.DB, "m1", "")
		a := takeLanes(t, s.DB, "a", time.Minute, 5)
		got := a.claim(t, s.DB, 5)
		require.Len(t, got, 1)
		expireLanes(t, s.DB, "a")
		tx, err := s.DB.BeginTx(ctx, nil)
		require.NoError(t, err)
		res, err := fencing.Apply(ctx, tx, published(got))
		require.NoError(t, err)
		require.Equal(t, []fencing.Result{fencing.Applied}, res)
		during := take(s.DB)
		if len(during.Owned) > 0 {
			_ = tx.Rollback() // do not leave the cleanup waiting on the open transaction
		}
		require.Empty(t, during.Owned, "the lanes are held by the outcome being written: none taken")
		require.NoError(t, tx.Commit())
		after := take(s.DB)
		require.Len(t, after.Owned, 32)
		require.Zero(t, after.Charged, "the row has its outcome: nothing to charge")
		st := state(t, s.DB, "m1")
		require.Equal(t, "PUBLISHED", st.Status)
		require.Equal(t, 1, st.Attempts)
	})
	t.Run("takeover first", func(t *testing.T) {
		s := laneDB(t)
		insert(t, s.DB, "m1", "")
		a := takeLanes(t, s.DB, "a", time.Minute, 5)
		got := a.claim(t, s.DB, 5)
		require.Len(t, got, 1)
		expireLanes(t, s.DB, "a")
		tx, err := s.DB.BeginTx(ctx, nil)
		require.NoError(t, err)
		require.Len(t, take(tx).Owned, 32)
		done := make(chan []fencing.Result, 1)
		go func() {
			res, err := fencing.Apply(ctx, s.DB, published(got))
			assert.NoError(t, err)
			done <- res
		}()
		waitFor(t, func() bool { return outcomeWaitsOnLock(t, s.DB) })
		require.NoError(t, tx.Commit())
		require.Equal(t, []fencing.Result{fencing.Stale}, <-done)
		st := state(t, s.DB, "m1")
		require.Equal(t, "AMBIGUOUS", st.Status)
		require.Equal(t, 1, st.Attempts, "charged once by the takeover, not written by the stale owner")
	})
}

// outcomeWaitsOnLock reports whether an outcome statement of the lane
// scheme waits for a lock.
func outcomeWaitsOnLock(t *testing.T, db *sql.DB) bool {
	var n int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM pg_stat_activity
		WHERE wait_event_type = 'Lock' AND query LIKE '%fence AS MATERIALIZED%' AND pid <> pg_backend_pid()`).Scan(&n))
	return n > 0
}

// A message whose publish kills every relay that takes it (no outcome is
// ever written) ends EXHAUSTED after its budget: each takeover charges it.
func TestAMessageThatKillsItsRelaysEndsExhausted(t *testing.T) {
	s := laneDB(t)
	insert(t, s.DB, "poison", "k")
	const budget = 3
	for i := range budget {
		r := takeLanes(t, s.DB, fmt.Sprintf("relay-%d", i), time.Minute, budget)
		got := r.claim(t, s.DB, budget)
		require.Equal(t, []string{"poison"}, ids(got), "attempt %d", i+1)
		expireLanes(t, s.DB, r.owner)
	}
	last := takeLanes(t, s.DB, "survivor", time.Minute, budget)
	require.Equal(t, 1, last.state.Parked)
	st := state(t, s.DB, "poison")
	require.Equal(t, "EXHAUSTED", st.Status)
	require.Equal(t, budget, st.Attempts)
	require.True(t, st.Parked)
	require.Empty(t, last.claim(t, s.DB, budget))
}

// A fleet runs one fence scheme: a lane relay refuses to start beside a
// live relay of the per-row scheme, and once the fleet runs on lanes the
// database refuses the per-row claim (a relay built before lanes).
func TestMixedFenceFleetIsRefused(t *testing.T) {
	s := laneDB(t)
	ctx := context.Background()
	insert(t, s.DB, "m1", "")
	_, err := s.DB.Exec(`INSERT INTO messaging_relay_heartbeat (owner, expires_at) VALUES ('old', now() + interval '1 minute')`)
	require.NoError(t, err)
	err = fencing.EnterFence(ctx, s.DB, "new", fencing.FenceLanes)
	require.ErrorIs(t, err, fencing.ErrFenceConflict)
	require.Contains(t, err.Error(), `"old"`)

	_, err = s.DB.Exec(`DELETE FROM messaging_relay_heartbeat`)
	require.NoError(t, err)
	require.NoError(t, fencing.EnterFence(ctx, s.DB, "new", fencing.FenceLanes))
	_, err = fencing.Claim(ctx, s.DB, params("old", time.Time{}))
	require.Error(t, err)
	require.Contains(t, err.Error(), string(fencing.CodeFenceConflict))
	require.Equal(t, 1, s.Count(t, "status = 'PENDING'"), "nothing was leased")

	_, err = s.DB.Exec(`INSERT INTO messaging_relay_heartbeat (owner, expires_at, fence) VALUES ('new', now() + interval '1 minute', 'LANES')`)
	require.NoError(t, err)
	err = fencing.EnterFence(ctx, s.DB, "old", fencing.FenceRows)
	require.ErrorIs(t, err, fencing.ErrFenceConflict)

	_, err = s.DB.Exec(`DELETE FROM messaging_relay_heartbeat`)
	require.NoError(t, err)
	require.NoError(t, fencing.EnterFence(ctx, s.DB, "old", fencing.FenceRows))
	got, err := fencing.Claim(ctx, s.DB, params("old", time.Time{}))
	require.NoError(t, err)
	require.Len(t, got, 1, "back on per-row leases once no lane relay runs")
}

// A lane relay refuses to start before the lanes' index is built: the
// migration leaves it out (it would cost every insert of a fleet on per-row
// leases an entry).
func TestLaneRelayNeedsTheLanesIndex(t *testing.T) {
	s := newDB(t)
	err := fencing.EnterFence(context.Background(), s.DB, "a", fencing.FenceLanes)
	require.ErrorIs(t, err, &outbox.Error{Code: fencing.CodeLanesMissing})
	require.Contains(t, err.Error(), "outboxctl lanes set 32")
	require.NoError(t, fencing.EnterFence(context.Background(), s.DB, "a", fencing.FenceRows), "per-row leases need no lane index")
	require.NoError(t, fencing.SetLaneCount(context.Background(), s.DB, 32, 25))
	require.NoError(t, fencing.EnterFence(context.Background(), s.DB, "a", fencing.FenceLanes))
}

// The lane count changes only while no lane is owned; afterwards the
// claims run on the new count.
func TestLaneCountChangesOnlyWhileNoLaneIsOwned(t *testing.T) {
	s := laneDB(t)
	ctx := context.Background()
	for i := range 30 {
		insert(t, s.DB, fmt.Sprintf("m%02d", i), fmt.Sprintf("k%d", i%7))
	}
	a := takeLanes(t, s.DB, "a", time.Minute, 5)
	err := fencing.SetLaneCount(ctx, s.DB, 8, 5)
	require.ErrorIs(t, err, fencing.ErrLanesBusy)
	n, err := fencing.LaneCount(ctx, s.DB)
	require.NoError(t, err)
	require.Equal(t, 32, n, "refused without a change")

	gone, err := fencing.GiveBackLanes(ctx, s.DB, "a", nil)
	require.NoError(t, err)
	require.Len(t, gone, 32)
	require.NoError(t, fencing.SetLaneCount(ctx, s.DB, 8, 5))
	n, err = fencing.LaneCount(ctx, s.DB)
	require.NoError(t, err)
	require.Equal(t, 8, n)
	a = takeLanes(t, s.DB, "a", time.Minute, 5)
	require.Len(t, a.state.Owned, 8)
	require.Len(t, a.claim(t, s.DB, 5), 30, "every key's chain, on 8 lanes")

	err = fencing.SetLaneCount(ctx, s.DB, 0, 5)
	require.ErrorIs(t, err, fencing.ErrInvalidArgument)
}

// Two live relays share the lanes: each takes at most its fair share, and
// neither claims the other's rows.
func TestTwoLaneRelaysShareTheLanes(t *testing.T) {
	s := laneDB(t)
	for i := range 200 {
		insert(t, s.DB, fmt.Sprintf("m%03d", i), "")
	}
	_, err := s.DB.Exec(`INSERT INTO messaging_relay_heartbeat (owner, expires_at, fence) VALUES
		('a', now() + interval '1 minute', 'LANES'), ('b', now() + interval '1 minute', 'LANES')`)
	require.NoError(t, err)
	a := takeLanes(t, s.DB, "a", time.Minute, 5)
	b := takeLanes(t, s.DB, "b", time.Minute, 5)
	require.Len(t, a.state.Owned, 16)
	require.Len(t, b.state.Owned, 16)
	ga, gb := a.claim(t, s.DB, 5), b.claim(t, s.DB, 5)
	require.Len(t, append(ga, gb...), 200)
	seen := map[string]bool{}
	for _, c := range append(ga, gb...) {
		require.False(t, seen[c.Row.MessageID], "claimed twice: %s", c.Row.MessageID)
		seen[c.Row.MessageID] = true
	}
	// b's outcome for a's row is refused by the fence.
	wrong := published(ga[:1])
	wrong[0].Lease.Owner = "b"
	res, err := fencing.Apply(context.Background(), s.DB, wrong)
	require.NoError(t, err)
	require.Equal(t, []fencing.Result{fencing.Stale}, res)
}

// waitFor polls cond until it holds (the condition is the event; the
// minute is only a bound for a stuck test).
func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	require.Eventually(t, cond, time.Minute, 2*time.Millisecond)
}

// docs/FENCE.md: a keyed row's lane is (hashtext(ordering_key) & 2147483647)
// % N, an unkeyed row's (seq >> 5) % N: runs of 32 consecutive rows. A relay
// holding one lane claims exactly those rows, and every row of a key or
// none.
func TestARowsLaneIsItsKeysHashOrItsSeqRun(t *testing.T) {
	s := laneDB(t)
	for i := range 200 {
		key := ""
		if i%4 == 0 {
			key = fmt.Sprintf("key-%d", i%40)
		}
		insert(t, s.DB, fmt.Sprintf("m%03d", i), key)
	}
	all := takeLanes(t, s.DB, "all", time.Minute, 5)
	require.Len(t, all.state.Owned, 32)
	// Lanes 0, 3 and 6 hold runs of unkeyed rows (seq 1-200), the lane of
	// key-0 that key's rows (and maybe other keys' and a run).
	var keyLane int
	require.NoError(t, s.DB.QueryRow(`SELECT (hashtext('key-0') & 2147483647) % 32`).Scan(&keyLane))
	keyed := 0
	for _, lane := range []int{0, 3, 6, keyLane} {
		one := &laneRelay{owner: "all", state: all.state}
		one.state.Owned = []fencing.LaneLease{all.state.Owned[lane]}
		require.Equal(t, lane, one.lanes()[0])
		var want []string
		rows, err := s.DB.Query(`SELECT message_id FROM messaging_outbox
			WHERE CASE WHEN ordering_key IS NULL THEN (seq >> 5) % 32
			           ELSE (hashtext(ordering_key) & 2147483647) % 32 END = $1 ORDER BY message_id`, lane)
		require.NoError(t, err)
		for rows.Next() {
			var id string
			require.NoError(t, rows.Scan(&id))
			want = append(want, id)
		}
		require.NoError(t, rows.Err())
		require.NotEmpty(t, want, "lane %d has rows", lane)
		var got []string
		for _, c := range one.claim(t, s.DB, 5) {
			got = append(got, c.Row.MessageID)
			if c.Row.OrderingKey != "" {
				keyed++
			}
		}
		require.ElementsMatch(t, want, got, "lane %d", lane)
	}
	require.GreaterOrEqual(t, keyed, 5, "key-0's five rows came with its lane")
}

// The held record of a lane, which a takeover charges an attempt each, is
// what its owner still holds there, then the new claim's rows, each with
// the attempts it had when claimed; a row written out in between is no
// longer in it.
func TestLaneHeldRecordKeepsWhatIsStillHeldThenTheNewRows(t *testing.T) {
	s := laneDB(t)
	for i := range 10 {
		insert(t, s.DB, fmt.Sprintf("u%02d", i), "")
	}
	_, err := s.DB.Exec(`UPDATE messaging_outbox SET attempts = 2, last_attempt_at = now() WHERE message_id IN ('u03', 'u07')`)
	require.NoError(t, err)
	require.NoError(t, fencing.EnterFence(context.Background(), s.DB, "a", fencing.FenceLanes))
	a := takeLanes(t, s.DB, "a", time.Minute, 5)
	got := a.claim(t, s.DB, 5)
	require.Len(t, got, 10)

	// Four are written out; the relay still holds the other six.
	var out []fencing.Claimed
	for _, c := range got {
		if c.Row.MessageID == "u00" || c.Row.MessageID == "u02" || c.Row.MessageID == "u05" || c.Row.MessageID == "u09" {
			out = append(out, c)
		}
	}
	_, err = fencing.Apply(context.Background(), s.DB, published(out))
	require.NoError(t, err)
	idOf := map[int64]string{}
	seqOf := map[string]int64{}
	for _, c := range got {
		idOf[c.Row.Seq], seqOf[c.Row.MessageID] = c.Row.MessageID, c.Row.Seq
	}
	a.held = nil
	for _, id := range []string{"u01", "u03", "u04", "u06", "u07", "u08"} {
		a.held = append(a.held, seqOf[id])
	}
	for i := 10; i < 13; i++ {
		insert(t, s.DB, fmt.Sprintf("u%02d", i), "")
	}
	for _, c := range a.claim(t, s.DB, 5) {
		idOf[c.Row.Seq] = c.Row.MessageID
	}
	require.Len(t, idOf, 13)

	var seqs, atts []int64
	require.NoError(t, s.DB.QueryRow(`SELECT held_seqs, held_attempts FROM messaging_relay_lane_held WHERE cardinality(held_seqs) > 0`).
		Scan(pq.Array(&seqs), pq.Array(&atts)))
	require.Len(t, seqs, 9)
	require.Len(t, atts, 9)
	held := map[string]int64{}
	for i, seq := range seqs {
		held[idOf[seq]] = atts[i]
	}
	require.Equal(t, map[string]int64{"u01": 0, "u03": 2, "u04": 0, "u06": 0, "u07": 2, "u08": 0, "u10": 0, "u11": 0, "u12": 0}, held)
	require.ElementsMatch(t, a.held[:6], seqs[:6], "what is still held comes first, the new claim's rows after it")
}

// ClaimParams.Held, the held rows by message id (deprecated for HeldSeqs),
// still keeps them from being claimed again: Claim looks their seqs up
// first, and records them on their lanes as held. ClaimStatement, which
// runs no query, refuses them with FENCING_INVALID_ARGUMENT.
func TestLaneClaimStillTakesHeldRowsByMessageID(t *testing.T) {
	ctx := context.Background()
	s := laneDB(t)
	for i := range 6 {
		insert(t, s.DB, fmt.Sprintf("u%02d", i), "")
	}
	a := takeLanes(t, s.DB, "a", time.Minute, 5)
	first := a.claim(t, s.DB, 5)
	require.Len(t, first, 6)
	insert(t, s.DB, "u06", "")

	p := fencing.ClaimParams{Owner: "a", Limit: 1000, MaxAttempts: 5, Lanes: a.lanes(), LaneCount: a.state.Total,
		Held: []string{"u00", "u01", "u02", "u03", "u04", "u05", "no-such-row"}}
	_, _, err := fencing.ClaimStatement(p)
	require.ErrorIs(t, err, fencing.ErrInvalidArgument)

	got, err := fencing.Claim(ctx, s.DB, p)
	require.NoError(t, err)
	require.Equal(t, []string{"u06"}, ids(got), "the held rows are not claimed again")
	var held int
	require.NoError(t, s.DB.QueryRow(`SELECT sum(cardinality(d.held_seqs)) FROM messaging_relay_lane_held d JOIN messaging_relay_lane l USING (lane) WHERE l.owner = 'a' AND d.epoch = l.epoch`).Scan(&held))
	require.Equal(t, 7, held, "what it still holds stays recorded beside the new row")
}

// The fair shares add up to the lane count, so every relay of a fleet
// holds exactly its share once each has renewed: none stays short (and
// tries to take a lane at every poll interval, none ever free), none holds
// fewer than the others but one. Three relays on 32 lanes hold 11, 11 and
// 10; five hold 7, 7, 6, 6 and 6.
func TestTheFairSharesAddUpToTheLanes(t *testing.T) {
	for _, owners := range [][]string{{"r1", "r2", "r3"}, {"r1", "r2", "r3", "r4", "r5"}} {
		t.Run(fmt.Sprint(len(owners)), func(t *testing.T) {
			s := laneDB(t)
			for _, o := range owners {
				_, err := s.DB.Exec(`INSERT INTO messaging_relay_heartbeat (owner, expires_at, fence) VALUES ($1, now() + interval '1 minute', 'LANES')`, o)
				require.NoError(t, err)
			}
			var held []int
			sum := 0
			for _, o := range owners {
				r := takeLanes(t, s.DB, o, time.Minute, 25)
				require.Len(t, r.state.Owned, r.state.Share, "%s holds its whole share", o)
				held = append(held, len(r.state.Owned))
				sum += r.state.Share
			}
			require.Equal(t, 32, sum, "the shares add up to the lanes")
			for i, n := range held {
				require.InDelta(t, 32/len(owners), n, 1, "relay %d holds %v", i, held)
			}
			var unowned int
			require.NoError(t, s.DB.QueryRow(`SELECT count(*) FROM messaging_relay_lane WHERE owner IS NULL`).Scan(&unowned))
			require.Zero(t, unowned)
			for _, o := range owners {
				r := takeLanes(t, s.DB, o, time.Minute, 25)
				require.Empty(t, r.state.Taken, "%s is not short: a renewal takes nothing", o)
				require.Len(t, r.state.Owned, r.state.Share)
			}
		})
	}
}

// LaneShare reads what TakeLanes would take as the owner's share (the
// lanes split between the live polling relays, the owner counted), and writes
// nothing: relays whose heartbeats expired, relays of the CDC mode and the
// owner's own heartbeat do not change it. Bad input is refused with a code.
func TestLaneShareReadsTheFairShareWithoutWriting(t *testing.T) {
	s := laneDB(t)
	ctx := context.Background()
	share := func(owner string) int {
		t.Helper()
		n, total, err := fencing.LaneShare(ctx, s.DB, owner)
		require.NoError(t, err)
		require.Equal(t, 32, total)
		return n
	}
	require.Equal(t, 32, share("a"), "alone")
	_, err := s.DB.Exec(`INSERT INTO messaging_relay_heartbeat (owner, expires_at, fence) VALUES
		('a', now() + interval '1 minute', 'LANES'), ('b', now() + interval '1 minute', 'LANES'),
		('c', now() + interval '1 minute', 'LANES'), ('gone', now() - interval '1 second', 'LANES')`)
	require.NoError(t, err)
	require.Equal(t, 11, share("a"), "three live relays: 32 / 3, and one of the remainder's two")
	require.Equal(t, 11, share("b"), "the second by name has the other")
	require.Equal(t, 10, share("c"), "the third has none")
	require.Equal(t, 8, share("d"), "a fourth, not yet beating, counts itself")
	_, err = s.DB.Exec(`INSERT INTO messaging_relay_heartbeat (owner, expires_at, kind, slot_name) VALUES ('cdc', now() + interval '1 minute', 'CDC', 'slot')`)
	require.NoError(t, err)
	require.Equal(t, 11, share("a"), "a CDC relay claims no lanes")

	r := takeLanes(t, s.DB, "a", time.Minute, 25)
	require.Len(t, r.state.Owned, 11, "TakeLanes takes the share LaneShare read")
	var lanesBefore, heartbeatsBefore string
	require.NoError(t, s.DB.QueryRow(`SELECT string_agg(l::text, ';' ORDER BY lane) FROM messaging_relay_lane l`).Scan(&lanesBefore))
	require.NoError(t, s.DB.QueryRow(`SELECT string_agg(h::text, ';' ORDER BY owner) FROM messaging_relay_heartbeat h`).Scan(&heartbeatsBefore))
	share("a")
	var lanesAfter, heartbeatsAfter string
	require.NoError(t, s.DB.QueryRow(`SELECT string_agg(l::text, ';' ORDER BY lane) FROM messaging_relay_lane l`).Scan(&lanesAfter))
	require.NoError(t, s.DB.QueryRow(`SELECT string_agg(h::text, ';' ORDER BY owner) FROM messaging_relay_heartbeat h`).Scan(&heartbeatsAfter))
	require.Equal(t, lanesBefore, lanesAfter, "LaneShare writes no lane")
	require.Equal(t, heartbeatsBefore, heartbeatsAfter, "nor a heartbeat")

	_, _, err = fencing.LaneShare(ctx, s.DB, "")
	require.ErrorIs(t, err, fencing.ErrInvalidArgument)
	_, err = s.DB.Exec(`DELETE FROM messaging_relay_lane_held; DELETE FROM messaging_relay_lane`)
	require.NoError(t, err)
	_, _, err = fencing.LaneShare(ctx, s.DB, "a")
	require.ErrorIs(t, err, &outbox.Error{Code: fencing.CodeLanesMissing})
}
