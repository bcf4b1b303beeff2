package forwarder

import (
	"runtime"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/fencing"
)

// A finished batch's memory is kept for the next claim however many
// garbage collections run in between (a draining relay collects several
// times per pass), emptied, up to keptBatches; a batch with a publish left
// running is not kept.
func TestBatchMemoryIsKeptAcrossCollections(t *testing.T) {
	f := &Forwarder{claimer: &claimer{mem: make(chan *batchMem, keptBatches)}}
	var taken []*batchMem
	for range keptBatches + 1 {
		m := f.claimer.takeMem()
		m.claimed = append(m.claimed, fencing.Claimed{Row: envelope.Row{MessageID: "m", Payload: []byte("p")}})
		taken = append(taken, m)
	}
	for _, m := range taken {
		f.claimer.giveMem(m)
	}
	require.Len(t, f.claimer.mem, keptBatches, "one batch more than keptBatches goes to the collector")
	runtime.GC()
	runtime.GC()
	for range keptBatches {
		m := f.claimer.takeMem()
		require.Contains(t, taken, m, "kept across collections")
		require.Empty(t, m.claimed)
		require.Equal(t, fencing.Claimed{}, m.claimed[:1][0], "emptied: it pins no payload")
	}

	left := f.claimer.takeMem()
	left.keep = false // a publish of this batch was left running
	f.claimer.giveMem(left)
	require.Empty(t, f.claimer.mem)
}
