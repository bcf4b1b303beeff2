package forwarder_test

import (
	"context"
	"database/sql"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// Lane floors under relays (migration 00052), with a REPEATABLE READ
// snapshot held throughout: a row written by plain SQL in a transaction
// that stays open while the relay drains the rows after it is delivered
// once it commits; the relay's floors then rise past everything it
// drained, and a new relay (a new owner of the lanes) starts at them and
// delivers the rows written since, and only those.
func TestLaneFloorsUnderRelays(t *testing.T) {
	t.Parallel() // waits on floors, which wait for the database's older transactions
	ctx := context.Background()
	// A database of its own: the floors wait for every transaction of
	// their database, and other suites' would hold them back.
	s := testdb.Isolated(t)
	s.DB.SetMaxOpenConns(6)
	require.NoError(t, fencing.SetLaneCount(ctx, s.DB, 32, 25))
	holder := s.Open(t)
	snap, err := holder.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelRepeatableRead, ReadOnly: true})
	require.NoError(t, err)
	defer func() { _ = snap.Rollback() }()
	_, err = snap.Exec(`SELECT 1 FROM messaging_outbox LIMIT 1`)
	require.NoError(t, err)

	ids := func(prefix string, n int) []string {
		out := make([]string, n)
		for i := range out {
			out[i] = fmt.Sprintf("%s%04d", prefix, i)
		}
		return out
	}
	insertN(t, s.DB, "orders", ids("a", 300)...)
	late, err := s.Open(t).Begin()
	require.NoError(t, err)
	defer func() { _ = late.Rollback() }()
	_, err = late.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload) VALUES ('late', 'orders', 'x')`)
	require.NoError(t, err)
	insertN(t, s.DB, "orders", ids("b", 300)...)

	cfg := forwarder.Config{Owner: "r1", Fence: forwarder.FenceLanes, BatchSize: 50, PollInterval: 10 * time.Millisecond}
	rec1 := &recorder{}
	f1 := newForwarder(t, s.DB, rec1, cfg)
	runOnceUntil := func(f *forwarder.Forwarder, what string, ok func() bool) {
		t.Helper()
		deadline := time.Now().Add(time.Minute)
		for !ok() {
			_, err := f.RunOnce(ctx)
			require.NoError(t, err)
			require.False(t, time.Now().After(deadline), what)
		}
	}
	runOnceUntil(f1, "the committed rows are delivered", func() bool { return len(rec1.ids()) == 600 })
	require.NotContains(t, rec1.ids(), "late")
	require.NoError(t, late.Commit())
	runOnceUntil(f1, "the row committed late is delivered", func() bool { return state(t, s.DB, "late").Status == "PUBLISHED" })

	var top int64
	require.NoError(t, s.DB.QueryRow(`SELECT max(seq) FROM messaging_outbox`).Scan(&top))
	floorsPast := func() bool {
		return testdb.QueryInt(t, s.DB, `SELECT count(*) FROM messaging_relay_lane WHERE floor_seq <= $1`, top) == 0
	}
	runOnceUntil(f1, "the relay raises its lanes' floors past what it drained", floorsPast)
	require.NoError(t, f1.Close())

	insertN(t, s.DB, "orders", ids("c", 100)...)
	require.True(t, floorsPast(), "the floors are the table's: the next relay starts there")
	rec2 := &recorder{}
	cfg.Owner = "r2"
	f2 := newForwarder(t, s.DB, rec2, cfg)
	runOnceUntil(f2, "the new rows are delivered", func() bool { return len(rec2.ids()) >= 100 })
	got := rec2.ids()
	slices.Sort(got)
	require.Equal(t, ids("c", 100), got, "the new relay delivers the new rows, once")
	require.True(t, floorsPast(), "no floor fell")
	require.Equal(t, 701, s.Count(t, "status = 'PUBLISHED'"))
	require.NoError(t, snap.Rollback())
}
