package forwarder

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/fencing"
)

func batchFrom(seqs ...int64) []fencing.Claimed {
	out := make([]fencing.Claimed, len(seqs))
	for i, s := range seqs {
		out[i] = fencing.Claimed{Row: envelope.Row{Seq: s}}
	}
	return out
}

// claimStart: the start point stays at the lowest seq of the last three full
// batches; a short batch, a failed claim and every rescanEvery-th claim start
// at the first entry again.
func TestClaimStartFollowsTheLastThreeBatches(t *testing.T) {
	var c claimStart
	claim := func(seqs ...int64) int64 {
		from := c.from()
		c.record(from, 2, batchFrom(seqs...), nil)
		return from
	}
	require.Zero(t, claim(10, 11), "the first claims start at the first entry")
	require.Zero(t, claim(20, 21))
	require.Zero(t, claim(30, 31))
	require.Equal(t, int64(10), claim(40, 41), "the lowest of the last three batches")
	require.Equal(t, int64(20), claim(50, 51))
	require.Equal(t, int64(30), c.from())

	// A claim that comes back short: the backlog seen from there is drained.
	c.record(c.from(), 2, batchFrom(60), nil)
	require.Zero(t, c.from())
	// So does a failed one.
	claim(70, 71)
	claim(80, 81)
	claim(90, 91)
	require.Equal(t, int64(70), c.from())
	c.record(c.from(), 2, nil, errors.New("connection reset"))
	require.Zero(t, c.from())

	// However long the drain, every rescanEvery-th claim starts at the first entry.
	for i := range int64(window) {
		claim(100+10*i, 101+10*i)
	}
	for i := range rescanEvery {
		require.NotZero(t, claim(int64(200+10*i), int64(201+10*i)), "claim %d after the rescan", i+1)
	}
	require.Zero(t, c.from(), "the rescan")
}
