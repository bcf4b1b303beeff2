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
		f := &Forwarder{cfg: cfg}
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
