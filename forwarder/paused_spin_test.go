package forwarder_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/await"
)

// Found by the chaos soak (issue 16, the downstream that hangs forever):
// while its claims are paused (more publishes left behind than
// MaxAbandoned) and a destination's breaker is open with its probe due, Run
// loops without waiting: a paused pass claims nothing, so the probe never
// runs and stays due, and Run cuts the idle delay to the due probe (0) and
// goes again at once. A short soak counted 85,318 paused passes in three
// relays over a 6 s hang window: a relay burns a core for as long as the
// downstream hangs. A paused pass should wait (PollInterval or the idle
// backoff) like any pass that claimed nothing; now it does (Run lets a due
// probe cut the wait only when claims are not paused).
func TestPausedClaimsWaitBetweenPassesWhileAProbeIsDue(t *testing.T) {
	s := newDB(t)
	for i := range 20 {
		insertN(t, s.DB, "orders", fmt.Sprintf("m%02d", i))
	}
	h := &hangCounter{release: make(chan struct{})}
	t.Cleanup(func() { close(h.release) })
	var paused atomic.Int64
	var firstPause atomic.Int64
	const poll = 50 * time.Millisecond
	f := newForwarder(t, s.DB, h, forwarder.Config{
		BatchSize: 1, Concurrency: 1, MaxAbandoned: 1,
		PublishTimeout: 20 * time.Millisecond, LeaseDuration: time.Second, DrainTimeout: 20 * time.Millisecond,
		PollInterval: poll, MaxPollInterval: 4 * poll,
		BreakerThreshold: 2, BreakerProbeBase: 10 * time.Millisecond, BreakerProbeMax: 20 * time.Millisecond,
		OnReport: func(r forwarder.Report) {
			if r.ClaimPaused {
				firstPause.CompareAndSwap(0, time.Now().UnixNano())
				paused.Add(1)
			}
		},
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	await.Until(t, func() bool { return paused.Load() > 0 }, "the relay never paused its claims")
	const watch = time.Second
	await.Until(t, func() bool { return time.Since(time.Unix(0, firstPause.Load())) >= watch }, "the watch window after the first pause passes")
	n := paused.Load()
	cancel()
	require.NoError(t, waitOrFail(t, done, "Run to return"))
	// At most one pass per PollInterval (the idle backoff only lengthens
	// the wait), with room for a slow machine.
	require.LessOrEqual(t, n, int64(2*watch/poll),
		"%d passes with claims paused in %s: the relay loops without waiting while a breaker probe is due", n, watch)
}
