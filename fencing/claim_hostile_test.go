package fencing_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/fencing"
)

// Regression (hostile review): a Continuation whose AfterID is a row the caller holds, but of
// another key (or another seq) than Key/AfterSeq. Claim checks only that
// AfterID is the caller's IN_FLIGHT row (or published), not that it is the
// row at AfterSeq of Key, so the caller gets the rows of Key behind a head
// that another relay holds: the key's next row can go out while its head is
// still with someone else. Guarantee: a row never goes out while an earlier
// row of its key is with someone else (package doc of fencing.Claim).
func TestHostileContinuationWithForeignAfterIDSkipsAnotherRelaysHead(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	insert(t, s.DB, "a1", "A")
	insert(t, s.DB, "a2", "A")
	insert(t, s.DB, "u1", "")
	// Relay "other" holds A's head (chain of 1).
	po := params("other", t0)
	po.MaxChain, po.NoUnkeyed = 1, true
	got, err := fencing.Claim(ctx, s.DB, po)
	require.NoError(t, err)
	require.Equal(t, []string{"a1"}, ids(got))
	// Relay "me" holds an unkeyed row.
	pm := params("me", t0)
	pm.NoKeyWalk = true
	mine, err := fencing.Claim(ctx, s.DB, pm)
	require.NoError(t, err)
	require.Equal(t, []string{"u1"}, ids(mine))
	// "me" continues key A behind a1, naming its own row u1.
	pc := params("me", t0)
	pc.NoKeyWalk, pc.NoUnkeyed = true, true
	pc.Continue = []fencing.Continuation{{Key: "A", AfterSeq: got[0].Row.Seq, AfterID: "u1"}}
	stolen, err := fencing.Claim(ctx, s.DB, pc)
	if err == nil {
		require.Empty(t, ids(stolen), "a2 claimed by 'me' while A's head a1 is held by 'other'")
	}
}
