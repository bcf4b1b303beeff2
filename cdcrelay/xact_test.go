package cdcrelay_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/cdcrelay"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// The walsender names a transaction by its 32-bit xid; the relay widens it
// to an xid8 to ask whether it has ended. The newest transaction in progress
// can be past the snapshot's xmax (latestCompletedXid+1): widening it must
// not step into an epoch before the first (on a young cluster that made
// PostgreSQL refuse with "transaction ID ... is in the future").
func TestXactStatusOfTheNewestTransaction(t *testing.T) {
	s := testdb.New(t)
	ctx := context.Background()
	// status reads the widened status of xid and, in the same snapshot,
	// xmax.
	status := func(xid int64) (string, int64) {
		t.Helper()
		var st string
		var xmax int64
		require.NoError(t, s.DB.QueryRowContext(ctx, `SELECT (`+cdcrelay.SQLXactStatus+`), pg_snapshot_xmax(pg_current_snapshot())::text::bigint`, xid).Scan(&st, &xmax))
		return st, xmax
	}
	begin := func() (func() error, int64) {
		t.Helper()
		tx, err := s.DB.BeginTx(ctx, nil)
		require.NoError(t, err)
		t.Cleanup(func() { _ = tx.Rollback() })
		var full int64
		require.NoError(t, tx.QueryRowContext(ctx, `SELECT pg_current_xact_id()::text::bigint`).Scan(&full))
		return tx.Rollback, full
	}
	// Two transactions in progress: the second one's xid is past xmax
	// unless a newer transaction of another session ended meanwhile (the
	// server is shared): then try again.
	exercised := false
	for range 50 {
		endFirst, _ := begin()
		end, full := begin()
		st, xmax := status(full & 0xFFFFFFFF)
		if full > xmax {
			exercised = true
			require.Equal(t, "in progress", st, "xid %d, xmax %d", full, xmax)
			require.NoError(t, end())
			st, _ = status(full & 0xFFFFFFFF)
			require.Equal(t, "aborted", st)
		}
		_ = end()
		_ = endFirst()
		if exercised {
			break
		}
	}
	require.True(t, exercised, "never had a transaction past xmax in 50 tries")

	// An older transaction, committed: found in the same epoch.
	var older int64
	require.NoError(t, s.DB.QueryRowContext(ctx, `SELECT pg_current_xact_id()::text::bigint`).Scan(&older))
	st, _ := status(older & 0xFFFFFFFF)
	require.Equal(t, "committed", st)
}
