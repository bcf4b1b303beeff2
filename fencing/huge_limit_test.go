package fencing_test

import (
	"context"
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/fencing"
)

// Claim's Limit is an upper bound for the statement, not a buffer size: a
// valid huge Limit (math.MaxInt) must claim the rows there are, keyed and
// unkeyed, under each form of the statement, without panicking in makeslice
// or sending the database a value its integer parameters cannot hold.
func TestClaimWithAHugeLimitReturnsTheRows(t *testing.T) {
	for name, mut := range map[string]func(*fencing.ClaimParams){
		"block key":    func(*fencing.ClaimParams) {},
		"skip parked":  func(p *fencing.ClaimParams) { p.Policy = fencing.SkipParked },
		"unkeyed only": func(p *fencing.ClaimParams) { p.NoKeyWalk = true },
	} {
		t.Run(name, func(t *testing.T) {
			s := newDB(t)
			insert(t, s.DB, "a", "")
			insert(t, s.DB, "b", "k1")
			insert(t, s.DB, "c", "k1")
			insert(t, s.DB, "d", "")
			p := withLimit(params("r", t0), math.MaxInt)
			mut(&p)
			var got []fencing.Claimed
			var err error
			require.NotPanics(t, func() { got, err = fencing.Claim(context.Background(), s.DB, p) })
			require.NoError(t, err)
			want := []string{"a", "b", "c", "d"}
			if p.NoKeyWalk {
				want = []string{"a", "d"}
			}
			require.Equal(t, want, ids(got))
			for _, c := range got {
				require.Equal(t, "IN_FLIGHT", state(t, s.DB, c.Row.MessageID).Status)
			}
		})
	}
}

// The same for ClaimAppend with a continuation: the caller's dst is only
// appended to, whatever Limit says.
func TestClaimAppendWithAHugeLimitContinuesAChain(t *testing.T) {
	s := newDB(t)
	insert(t, s.DB, "a", "k1")
	insert(t, s.DB, "b", "k1")
	insert(t, s.DB, "c", "k1")
	ctx := context.Background()
	p := params("r", t0)
	p.Limit, p.MaxChain = 1, 1
	dst, err := fencing.ClaimAppend(ctx, s.DB, nil, p)
	require.NoError(t, err)
	require.Equal(t, []string{"a"}, ids(dst))

	p = withLimit(params("r", t0), math.MaxInt)
	p.NoKeyWalk = true
	p.Continue = []fencing.Continuation{{Key: "k1", AfterSeq: dst[0].Row.Seq, AfterID: "a"}}
	var got []fencing.Claimed
	require.NotPanics(t, func() { got, err = fencing.ClaimAppend(ctx, s.DB, dst, p) })
	require.NoError(t, err)
	require.Equal(t, []string{"a", "b", "c"}, ids(got))
}
