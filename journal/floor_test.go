package journal_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/journal"
)

// A redrive makes a parked row claimable again below its lane's floor (a
// lane relay's claims start there, migration 00052): it lowers the floor
// in the same transaction, and the row is claimed and delivered.
func TestRedriveLowersTheLaneFloorsAndTheRowIsClaimed(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	// A database of its own: the floors wait for every transaction of
	// their database, and other suites' would hold them back.
	s := testdb.Isolated(t)
	s.DB.SetMaxOpenConns(6)
	require.NoError(t, fencing.SetLaneCount(ctx, s.DB, 32, 5))
	rows := make([]testdb.OutboxRow, 200)
	for i := range rows {
		rows[i] = testdb.Row(envelope.Row{MessageID: fmt.Sprintf("u%04d", i), Destination: "orders", Payload: []byte("p")})
	}
	testdb.InsertRows(t, s.DB, rows...)
	st, err := fencing.TakeLanes(ctx, s.DB, fencing.LaneParams{Owner: "r", TTL: time.Minute, MaxAttempts: 5})
	require.NoError(t, err)
	lanes := make([]int, len(st.Owned))
	for i, l := range st.Owned {
		lanes[i] = l.Lane
	}
	p := fencing.ClaimParams{Owner: "r", Limit: 1000, MaxAttempts: 5, Lanes: lanes, LaneCount: 32}
	got, err := fencing.Claim(ctx, s.DB, p)
	require.NoError(t, err)
	require.Len(t, got, 200)
	var parkedSeq int64
	outs := make([]fencing.Outcome, 0, len(got))
	for _, c := range got {
		o := fencing.Outcome{Lease: c.Lease, To: envelope.StatusPublished}
		if c.Row.MessageID == "u0005" {
			o = fencing.Outcome{Lease: c.Lease, To: envelope.StatusFailed, Code: "REJECTED", Detail: "no"}
			parkedSeq = c.Row.Seq
		}
		outs = append(outs, o)
	}
	_, err = fencing.Apply(ctx, s.DB, outs)
	require.NoError(t, err)
	lane := int((parkedSeq >> 5) % 32)

	// The floors rise past everything, the parked row included.
	var top int64
	require.NoError(t, s.DB.QueryRow(`SELECT max(seq) FROM messaging_outbox`).Scan(&top))
	deadline := time.Now().Add(time.Minute)
	for testdb.QueryInt(t, s.DB, `SELECT count(*) FROM messaging_relay_lane WHERE floor_seq <= $1`, top) > 0 {
		_, err := fencing.AdvanceLaneFloors(ctx, s.DB, "r", lanes, 32)
		require.NoError(t, err)
		require.False(t, time.Now().After(deadline), "the floors did not rise past the drained rows")
		time.Sleep(10 * time.Millisecond) // the loop's exit is the floors' state
	}
	p.Limit = 10
	none, err := fencing.Claim(ctx, s.DB, p)
	require.NoError(t, err)
	require.Empty(t, none)

	out, err := newJournal(t, s.DB, "ops", nil, 50).Redrive(ctx, "T-FLOOR", journal.Filter{}, journal.Options{})
	require.NoError(t, err)
	require.EqualValues(t, 1, out.Items)
	floors, err := fencing.LaneFloorsOf(ctx, s.DB)
	require.NoError(t, err)
	require.LessOrEqual(t, floors[lane], parkedSeq, "the redrive lowered the floor of the row's lane")
	require.Zero(t, testdb.QueryInt(t, s.DB, `SELECT count(*) FROM messaging_relay_lane WHERE floor_cand_seq IS NOT NULL`), "and dropped the candidates")

	again, err := fencing.Claim(ctx, s.DB, p)
	require.NoError(t, err)
	require.Len(t, again, 1)
	require.Equal(t, "u0005", again[0].Row.MessageID)
	res, err := fencing.Apply(ctx, s.DB, []fencing.Outcome{{Lease: again[0].Lease, To: envelope.StatusPublished}})
	require.NoError(t, err)
	require.Equal(t, []fencing.Result{fencing.Applied}, res)
}

// A redrive of keyed rows only leaves the floors alone (the floors bound
// the unkeyed rows' descents only).
func TestRedriveOfKeyedRowsLeavesTheFloors(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := newSchema(t)
	_, err := s.DB.Exec(`UPDATE messaging_relay_lane SET floor_seq = 1000, floor_cand_seq = 1000, floor_cand_at = now()`)
	require.NoError(t, err)
	testdb.InsertRow(t, s.DB, envelope.Row{MessageID: "k1", Destination: "orders", Payload: []byte("p"), OrderingKey: "order-1",
		Status: envelope.StatusFailed, Attempts: 1, ParkedAt: t0, LastFailureCode: "REJECTED"})
	out, err := newJournal(t, s.DB, "ops", nil, 50).Redrive(ctx, "T-KEYED", journal.Filter{}, journal.Options{})
	require.NoError(t, err)
	require.EqualValues(t, 1, out.Items)
	require.Zero(t, testdb.QueryInt(t, s.DB, `SELECT count(*) FROM messaging_relay_lane WHERE floor_seq <> 1000 OR floor_cand_seq IS NULL`))
}
