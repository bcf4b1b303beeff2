package fencing_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/fencing"
)

// A claim takes per key the head and the claimable rows right behind it (at
// most MaxChain), in seq order beside unkeyed rows; a continuation extends a
// chain its owner holds; the walk over keys starts after the cursor and
// wraps around once.
func TestClaimTakesChainsContinuationsAndRotatesKeys(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	for _, r := range [][2]string{
		{"a1", "A"}, {"b1", "B"}, {"u1", ""}, {"a2", "A"}, {"b2", "B"}, {"a3", "A"},
		{"b3", "B"}, {"a4", "A"}, {"b4", "B"}, {"c1", "C"}, {"d1", "D"},
	} {
		insert(t, s.DB, r[0], r[1])
	}
	p := params("r", t0)
	p.MaxChain = 2
	first, err := fencing.Claim(ctx, s.DB, p)
	require.NoError(t, err)
	require.Equal(t, []string{"a1", "b1", "u1", "a2", "b2", "c1", "d1"}, ids(first), "chains of at most 2, in seq order")
	require.Equal(t, "D", fencing.NextKeyCursor("", first, nil))

	// Nothing of A or B is claimable by anyone while their chains are held.
	other, err := fencing.Claim(ctx, s.DB, params("other", t0))
	require.NoError(t, err)
	require.Empty(t, other)

	// The owner extends its chains behind the rows it holds.
	byID := map[string]fencing.Claimed{}
	for _, c := range first {
		byID[c.Row.MessageID] = c
	}
	cont := p
	cont.NoKeyWalk, cont.NoUnkeyed = true, true
	cont.Continue = []fencing.Continuation{
		{Key: "A", AfterSeq: byID["a2"].Row.Seq, AfterID: "a2"},
		{Key: "B", AfterSeq: byID["b2"].Row.Seq, AfterID: "b2"},
	}
	more, err := fencing.Claim(ctx, s.DB, cont)
	require.NoError(t, err)
	require.Equal(t, []string{"a3", "b3", "a4", "b4"}, ids(more))

	// A continuation behind a row the owner does not hold takes nothing.
	_, err = fencing.Release(ctx, s.DB, byID["c1"].Lease, t0)
	require.NoError(t, err)
	insert(t, s.DB, "c2", "C")
	stranger := params("other", t0)
	stranger.NoKeyWalk, stranger.NoUnkeyed = true, true
	stranger.Continue = []fencing.Continuation{{Key: "D", AfterSeq: byID["d1"].Row.Seq, AfterID: "d1"}}
	got, err := fencing.Claim(ctx, s.DB, stranger)
	require.NoError(t, err)
	require.Empty(t, got, "d1 is held by r, not by other")

	// The walk starts after the cursor and wraps: from "C", D is held, then
	// A and B are held and C is free again.
	rot := params("r", t0)
	rot.KeyCursor = "C"
	again, err := fencing.Claim(ctx, s.DB, rot)
	require.NoError(t, err)
	require.Equal(t, []string{"c1", "c2"}, ids(again))
	require.Equal(t, "C", fencing.NextKeyCursor("C", again, nil), "a wrapped walk's last key")

	// Bad continuations are refused before touching the database.
	bad := params("r", t0)
	bad.Continue = []fencing.Continuation{{Key: "A"}}
	_, err = fencing.Claim(ctx, s.DB, bad)
	require.ErrorIs(t, err, fencing.ErrInvalidArgument)
	bad.Continue = []fencing.Continuation{{Key: "A", AfterSeq: 1, AfterID: "a1"}, {Key: "A", AfterSeq: 2, AfterID: "a2"}}
	_, err = fencing.Claim(ctx, s.DB, bad)
	require.ErrorIs(t, err, fencing.ErrInvalidArgument)
	bad.Continue, bad.MaxChain = nil, -1
	_, err = fencing.Claim(ctx, s.DB, bad)
	require.ErrorIs(t, err, fencing.ErrInvalidArgument)
}

// MaxContinued bounds what one claim adds to a continued chain, however
// large the claim: a chain goes out one message at a time, so its length,
// not the claim's, decides how long the batch takes.
func TestMaxContinuedBoundsAContinuedChain(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	for i := range 10 {
		insert(t, s.DB, fmt.Sprintf("a%02d", i), "A")
	}
	insert(t, s.DB, "u1", "")
	p := params("r", t0)
	p.MaxChain = 1
	first, err := fencing.Claim(ctx, s.DB, p)
	require.NoError(t, err)
	require.Equal(t, []string{"a00", "u1"}, ids(first))
	cont := params("r", t0)
	cont.NoKeyWalk, cont.NoUnkeyed, cont.MaxContinued = true, true, 3
	cont.Continue = []fencing.Continuation{{Key: "A", AfterSeq: first[0].Row.Seq, AfterID: "a00"}}
	more, err := fencing.Claim(ctx, s.DB, cont)
	require.NoError(t, err)
	require.Equal(t, []string{"a01", "a02", "a03"}, ids(more), "three rows added behind a00, though the claim's limit is 100")

	cont.MaxContinued = -1
	_, err = fencing.Claim(ctx, s.DB, cont)
	require.ErrorIs(t, err, fencing.ErrInvalidArgument)
}

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
