package fencing_test

import (
	"context"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// MaxBytes cuts a claim in seq order where the payloads and headers would
// exceed it, in the statement itself (the rows cut off stay PENDING); the
// first row goes out whatever its size, alone if it is over the budget. A
// key's chain cut by it is still its prefix.
func TestClaimTakesAtMostMaxBytes(t *testing.T) {
	const kib = 1024
	for name, p := range map[string]func(fencing.ClaimParams) fencing.ClaimParams{
		"block-key":    func(p fencing.ClaimParams) fencing.ClaimParams { return p },
		"skip-parked":  func(p fencing.ClaimParams) fencing.ClaimParams { p.Policy = fencing.SkipParked; return p },
		"unkeyed only": func(p fencing.ClaimParams) fencing.ClaimParams { p.NoKeyWalk = true; return p },
	} {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			s := newDB(t)
			keyed := name != "unkeyed only"
			for _, r := range []struct {
				id, key string
				size    int
			}{{"big", "", 64 * kib}, {"a", "", kib}, {"b", "k", kib}, {"c", "k", kib}, {"d", "", kib}, {"e", "k", kib}} {
				if !keyed {
					r.key = ""
				}
				testdb.InsertRow(t, s.DB, envelope.Row{MessageID: r.id, Destination: "orders", Payload: []byte(strings.Repeat("x", r.size)), OrderingKey: r.key})
			}
			// A budget below the first row: it goes out alone.
			c, err := fencing.Claim(ctx, s.DB, p(fencing.ClaimParams{Owner: "r", Limit: 100, Lease: 30e9, MaxAttempts: 3, Now: t0, MaxBytes: kib}))
			require.NoError(t, err)
			require.Equal(t, []string{"big"}, ids(c))
			// Room for three rows of 1 KiB with their headers, not four.
			c, err = fencing.Claim(ctx, s.DB, p(fencing.ClaimParams{Owner: "r", Limit: 100, Lease: 30e9, MaxAttempts: 3, Now: t0, MaxBytes: 3*kib + 100}))
			require.NoError(t, err)
			require.Equal(t, []string{"a", "b", "c"}, ids(c))
			require.Equal(t, "PENDING", state(t, s.DB, "d").Status)
			// No bound: the rest (a keyed e waits behind b and c, in flight).
			c, err = fencing.Claim(ctx, s.DB, p(fencing.ClaimParams{Owner: "r", Limit: 100, Lease: 30e9, MaxAttempts: 3, Now: t0}))
			require.NoError(t, err)
			want := []string{"d", "e"}
			if keyed {
				want = []string{"d"}
			}
			require.Equal(t, want, ids(c))
		})
	}
	_, err := fencing.Claim(context.Background(), nil, fencing.ClaimParams{Owner: "r", Limit: 1, Lease: 1e9, MaxAttempts: 1, MaxBytes: -1})
	require.ErrorIs(t, err, fencing.ErrInvalidArgument)
}

// StrictBytes: the first row must fit too (a statement completing a batch
// that holds rows already); without a budget it changes nothing.
func TestStrictBytesBoundsTheFirstRowToo(t *testing.T) {
	const kib = 1024
	ctx := context.Background()
	s := newDB(t)
	testdb.InsertRow(t, s.DB, envelope.Row{MessageID: "big", Destination: "orders", Payload: []byte(strings.Repeat("x", 64*kib))})
	testdb.InsertRow(t, s.DB, envelope.Row{MessageID: "small", Destination: "orders", Payload: []byte("x")})
	for _, noKeyWalk := range []bool{true, false} { // the unkeyed statement and the general one
		c, err := fencing.Claim(ctx, s.DB, fencing.ClaimParams{Owner: "r", Limit: 100, Lease: 30e9, MaxAttempts: 3, Now: t0,
			MaxBytes: kib, StrictBytes: true, NoKeyWalk: noKeyWalk})
		require.NoError(t, err)
		require.Empty(t, ids(c), "the first row is over the budget: nothing is claimed")
	}
	c, err := fencing.Claim(ctx, s.DB, fencing.ClaimParams{Owner: "r", Limit: 100, Lease: 30e9, MaxAttempts: 3, Now: t0, StrictBytes: true})
	require.NoError(t, err)
	require.Equal(t, []string{"big", "small"}, ids(c), "no budget: no bound")
}

// ReleaseUnheld puts back the owner's IN_FLIGHT rows that the caller does
// not hold, without spending attempts, and touches nobody else's.
func TestReleaseUnheldReleasesOnlyWhatTheCallerDoesNotHold(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	for _, id := range []string{"held", "lost", "other"} {
		insert(t, s.DB, id, "")
	}
	p := params("r", t0)
	p.Limit = 2
	c, err := fencing.Claim(ctx, s.DB, p)
	require.NoError(t, err)
	require.Equal(t, []string{"held", "lost"}, ids(c))
	c, err = fencing.Claim(ctx, s.DB, params("someone-else", t0))
	require.NoError(t, err)
	require.Equal(t, []string{"other"}, ids(c))
	released, err := fencing.ReleaseUnheld(ctx, s.DB, "r", []string{"held"})
	require.NoError(t, err)
	require.Equal(t, []string{"lost"}, released)
	require.Equal(t, "PENDING", state(t, s.DB, "lost").Status)
	require.Zero(t, state(t, s.DB, "lost").Attempts)
	require.Equal(t, "IN_FLIGHT", state(t, s.DB, "held").Status)
	require.Equal(t, "IN_FLIGHT", state(t, s.DB, "other").Status)
	_, err = fencing.ReleaseUnheld(ctx, s.DB, "", nil)
	require.ErrorIs(t, err, fencing.ErrInvalidArgument)
}
