package fencing_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/fencing"
)

// ClaimAppend's doc: the claimed rows are appended to dst in seq order,
// and on an error dst comes back unchanged (the rows before it intact, the
// slice no longer), so a relay's batch survives a failed statement.
func TestClaimAppendLeavesDstAloneOnAnError(t *testing.T) {
	s := newDB(t)
	for _, id := range []string{"a", "b", "c"} {
		insert(t, s.DB, id, "")
	}
	ctx := context.Background()
	dst, err := fencing.ClaimAppend(ctx, s.DB, make([]fencing.Claimed, 0, 8), withLimit(params("r", t0), 1))
	require.NoError(t, err)
	require.Equal(t, []string{"a"}, ids(dst))

	// Refused before the database: dst as it was.
	bad := params("r", t0)
	bad.Owner = ""
	got, err := fencing.ClaimAppend(ctx, s.DB, dst, bad)
	require.ErrorIs(t, err, fencing.ErrInvalidArgument)
	require.Equal(t, []string{"a"}, ids(got))

	// Failed on the database's side (a cancelled context): dst as it was,
	// and nothing claimed.
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	got, err = fencing.ClaimAppend(cctx, s.DB, dst, params("r", t0))
	require.Error(t, err)
	require.Equal(t, []string{"a"}, ids(got))
	require.Equal(t, "PENDING", state(t, s.DB, "b").Status)

	// Appended after dst's rows, in seq order.
	got, err = fencing.ClaimAppend(ctx, s.DB, dst, params("r", t0))
	require.NoError(t, err)
	require.Equal(t, []string{"a", "b", "c"}, ids(got))
}

func withLimit(p fencing.ClaimParams, n int) fencing.ClaimParams {
	p.Limit = n
	return p
}
