package forwarder

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The chain is sized by the slowest destination lately: its last measured
// mean stays while it has no publishes, and is forgotten paceForgetAfter
// claims after its last one. Publishes to destinations past the table's
// bound count in the mean, and the slowest is then no less than the mean.
func TestPacesFollowTheSlowestDestinationLately(t *testing.T) {
	var p paces
	mean, slowest := p.take()
	require.Zero(t, mean, "nothing timed")
	require.Zero(t, slowest)

	p.add("fast", time.Millisecond)
	p.add("fast", 3*time.Millisecond)
	p.add("slow", 20*time.Millisecond)
	mean, slowest = p.take()
	require.Equal(t, 8*time.Millisecond, mean)
	require.Equal(t, 20*time.Millisecond, slowest)

	p.add("fast", time.Millisecond)
	mean, slowest = p.take()
	require.Equal(t, time.Millisecond, mean)
	require.Equal(t, 20*time.Millisecond, slowest, "slow keeps its pace while it has no publishes")
	for range paceForgetAfter - 1 {
		_, slowest = p.take()
		require.Equal(t, 20*time.Millisecond, slowest)
	}
	_, slowest = p.take()
	require.Equal(t, time.Millisecond, slowest, "fast, idle as long, was seen a claim later")
	_, slowest = p.take()
	require.Zero(t, slowest, "both forgotten")
	require.Empty(t, p.by)

	for i := range maxPacedDestinations {
		p.add(fmt.Sprint("d", i), time.Millisecond)
	}
	p.add("beyond", 50*time.Millisecond)
	require.Len(t, p.by, maxPacedDestinations)
	mean, slowest = p.take()
	require.Greater(t, mean, time.Millisecond)
	require.Equal(t, mean, slowest, "an untracked destination: the slowest is at least the mean")
}

// A woken pass that finds nothing is ordinary (its row was claimed by the
// pass running when the notification came) and holds nothing back; two in
// a row start the gap, until a woken pass claims rows again.
func TestWakeLimitHoldsBackFromTheSecondEmptyWokenPass(t *testing.T) {
	var w wakeLimit
	t0 := time.Unix(1000, 0)
	w.passed(t0, 3)
	w.passed(t0.Add(time.Millisecond), 0)
	require.True(t, w.idleAt.IsZero(), "one empty woken pass holds nothing back")
	w.passed(t0.Add(2*time.Millisecond), 1)
	w.passed(t0.Add(3*time.Millisecond), 0)
	require.True(t, w.idleAt.IsZero(), "nor one after a pass that claimed rows")
	w.passed(t0.Add(4*time.Millisecond), 0)
	require.Equal(t, t0.Add(4*time.Millisecond), w.idleAt, "the second in a row starts the gap")
	w.passed(t0.Add(60*time.Millisecond), 0)
	require.Equal(t, t0.Add(60*time.Millisecond), w.idleAt, "a flood keeps it going")
	w.passed(t0.Add(120*time.Millisecond), 2)
	w.passed(t0.Add(121*time.Millisecond), 0)
	require.Equal(t, t0.Add(60*time.Millisecond), w.idleAt, "rows again: the next empty pass starts no new gap")
}
