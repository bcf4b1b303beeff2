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
// is at or past the snapshot's xmax (latestCompletedXid+1): widening it must
// not step into an epoch before the first (on a young cluster that made
// PostgreSQL refuse with "transaction ID ... is in the future").
func TestXactStatusOfTheNewestTransaction(t *testing.T) {
	s := testdb.New(t)
	ctx := context.Background()

	// Two transactions in progress: the second one's xid is past xmax.
	first, err := s.DB.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer func() { _ = first.Rollback() }()
	require.NoError(t, first.QueryRowContext(ctx, `SELECT pg_current_xact_id()::text::bigint`).Scan(new(int64)))
	tx, err := s.DB.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback() }()
	var full, xmax int64
	require.NoError(t, tx.QueryRowContext(ctx, `SELECT pg_current_xact_id()::text::bigint`).Scan(&full))
	require.NoError(t, s.DB.QueryRowContext(ctx, `SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint`).Scan(&xmax))
	require.Greater(t, full, xmax, "the case that failed: an xid past xmax")

	status := func(xid int64) string {
		t.Helper()
		var st string
		require.NoError(t, s.DB.QueryRowContext(ctx, cdcrelay.SQLXactStatus, xid).Scan(&st))
		return st
	}
	require.Equal(t, "in progress", status(full&0xFFFFFFFF))

	// An older transaction, committed: found in the same epoch.
	var older int64
	require.NoError(t, s.DB.QueryRowContext(ctx, `SELECT pg_current_xact_id()::text::bigint`).Scan(&older))
	require.Equal(t, "committed", status(older&0xFFFFFFFF))

	require.NoError(t, tx.Rollback())
	require.Equal(t, "aborted", status(full&0xFFFFFFFF))
}
