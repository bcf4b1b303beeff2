package forwarder

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestLoopBackoffJitterIsPerOwnerAndBounded(t *testing.T) {
	mk := func(owner string) *Forwarder {
		cfg, err := Config{Owner: owner}.validated()
		require.NoError(t, err)
		f := &Forwarder{env: &env{cfg: cfg}}
		f.seed = seedOf(owner)
		return f
	}
	a, a2, b := mk("relay-a"), mk("relay-a"), mk("relay-b")
	differs := 0
	for n := 1; n <= 8; n++ {
		full := min(500*time.Millisecond<<(n-1), 5*time.Second)
		d := a.jittered(500*time.Millisecond, 5*time.Second, n, 1)
		require.Equal(t, d, a2.jittered(500*time.Millisecond, 5*time.Second, n, 1), "deterministic for an owner")
		require.GreaterOrEqual(t, d, full/2)
		require.LessOrEqual(t, d, full)
		if d != b.jittered(500*time.Millisecond, 5*time.Second, n, 1) {
			differs++
		}
	}
	require.GreaterOrEqual(t, differs, 7, "replicas do not poll in lockstep")
	require.Equal(t, 5*time.Second, exp(time.Second, 5*time.Second, 1000), "no overflow past the cap")
	require.Equal(t, time.Second, exp(time.Second, 5*time.Second, 0))
}

// The retry horizon the README and Config's documentation state: at the
// defaults, a message that keeps failing on its own is parked EXHAUSTED
// between 1 h 18 min and 2 h 37 min after its first attempt (the sum of the
// MaxAttempts-1 jittered delays, each between half and all of its nominal
// value), and never sooner than an hour.
func TestDefaultRetryHorizonIsAtLeastAnHour(t *testing.T) {
	c := Config{}.withDefaults()
	var nominal time.Duration
	for attempt := 1; attempt < c.MaxAttempts; attempt++ {
		nominal += exp(c.BackoffBase, c.BackoffMax, attempt)
	}
	shortest, longest := nominal/2, nominal
	require.GreaterOrEqual(t, shortest, time.Hour)
	require.Equal(t, 78*time.Minute, shortest.Truncate(time.Minute))
	require.Equal(t, 157*time.Minute, longest.Truncate(time.Minute))
	// The delays RetryDelay really draws stay inside those bounds.
	f := &Forwarder{env: &env{cfg: c}}
	var drawn time.Duration
	for attempt := 1; attempt < c.MaxAttempts; attempt++ {
		drawn += f.RetryDelay("some-message", attempt)
	}
	require.GreaterOrEqual(t, drawn, shortest)
	require.LessOrEqual(t, drawn, longest)
}
