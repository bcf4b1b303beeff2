package forwarder

import (
	"errors"
	"strconv"
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

// claimStart: the start point is right after the last unkeyed row of the
// latest full batch; a short batch, a failed claim, rows given back and
// every rescanEvery-th claim start at the first entry again.
func TestClaimStartFollowsTheLatestBatch(t *testing.T) {
	var c claimStart
	claim := func(seqs ...int64) int64 {
		from := c.from()
		c.record(from, 2, batchFrom(seqs...), nil)
		return from
	}
	require.Zero(t, claim(10, 11), "the first claim starts at the first entry")
	require.Equal(t, int64(12), claim(20, 21), "right after the latest batch")
	require.Equal(t, int64(22), claim(30, 31))

	// Keyed rows do not move the start point: it bounds unkeyed rows only.
	keyed := batchFrom(40, 41, 42)
	keyed[2].Row.OrderingKey = "k"
	c.record(c.from(), 2, keyed, nil)
	require.Equal(t, int64(42), c.from())

	// A claim that comes back short: the backlog seen from there is drained.
	c.record(c.from(), 2, batchFrom(60), nil)
	require.Zero(t, c.from())
	// So does a failed one.
	claim(70, 71)
	require.Equal(t, int64(72), c.from())
	c.record(c.from(), 2, nil, errors.New("connection reset"))
	require.Zero(t, c.from())
	// And rows given back by a pass.
	claim(80, 81)
	require.Equal(t, int64(82), c.from())
	c.reset()
	require.Zero(t, c.from())

	// However long the drain, every rescanEvery-th claim starts at the first entry.
	claim(100, 101)
	for i := range rescanEvery {
		require.NotZero(t, claim(int64(200+10*i), int64(201+10*i)), "claim %d after the rescan", i+1)
	}
	require.Zero(t, c.from(), "the rescan")
}

// mergeBySeq: the batch comes out in seq order, each row once, as the
// later statement returned it; rows already in order stay where they are.
func TestMergeBySeqKeepsTheLaterStatementsRow(t *testing.T) {
	tokens := func(b []fencing.Claimed) (seqs, toks []int64) {
		for _, c := range b {
			seqs, toks = append(seqs, c.Row.Seq), append(toks, c.Row.LeaseToken)
		}
		return seqs, toks
	}
	withToken := func(tok int64, seqs ...int64) []fencing.Claimed {
		b := batchFrom(seqs...)
		for i := range b {
			b[i].Row.LeaseToken, b[i].Row.MessageID = tok, strconv.FormatInt(b[i].Row.Seq, 10)
		}
		return b
	}

	// Rows below the first statement's, one of them claimed again.
	buf := append(withToken(1, 5, 7, 9), withToken(2, 1, 3, 7)...)
	seqs, toks := tokens(mergeBySeq(buf))
	require.Equal(t, []int64{1, 3, 5, 7, 9}, seqs)
	require.Equal(t, []int64{2, 2, 1, 2, 1}, toks, "seq 7 as the second statement returned it")

	// Already in order, with a row claimed again right at the boundary.
	buf = append(withToken(1, 1, 2, 3), withToken(2, 3, 4)...)
	seqs, toks = tokens(mergeBySeq(buf))
	require.Equal(t, []int64{1, 2, 3, 4}, seqs)
	require.Equal(t, []int64{1, 1, 2, 2}, toks)

	require.Empty(t, mergeBySeq(nil))
}
