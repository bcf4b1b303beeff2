package forwarder

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/fencing"
)

// A lane over the share is given back only once nothing claimed before it
// was marked is held, and a claim still running counts: its statements may
// have recorded rows on the lane before it records them as held.
func TestHeldSinceCountsTheClaimInProgress(t *testing.T) {
	cl := &claimer{}
	mark := time.Now()
	require.False(t, cl.heldSince(mark), "nothing claimed")

	cl.setClaiming(mark.Add(-time.Millisecond))
	require.True(t, cl.heldSince(mark), "a claim that started before the mark, still running")
	require.False(t, cl.heldSince(mark.Add(-time.Second)), "a claim that started after a mark read no lane it marked")

	cl.hold([]fencing.Claimed{{Row: envelope.Row{MessageID: "m", Seq: 7, Status: envelope.StatusInFlight}}}, mark.Add(-time.Millisecond))
	cl.setClaiming(time.Time{})
	require.True(t, cl.heldSince(mark), "its rows, once recorded, are held until their outcomes")
	cl.unhold([]fencing.Outcome{{Lease: fencing.Lease{MessageID: "m"}}})
	require.False(t, cl.heldSince(mark), "outcome written: the lane can go")
}
