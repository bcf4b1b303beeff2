package forwarder_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/await"
)

// A pass whose claim fails (the database refuses the statement) backs off
// (BackoffBase, doubling to BackoffMax) before the next one. But a breaker
// probe that is due cuts every wait, that backoff included, and a pass whose
// claim fails runs no probe, so the probe stays due and Run goes again at
// once: a relay whose database is down while one of its breakers is open
// (the two often go together: a network partition) hammers the database
// in a tight loop, the spin 18c08c1 fixed for paused claims only.
func TestFailingClaimsBackOffWhileABreakerProbeIsDue(t *testing.T) {
	s := newDB(t)
	for i := range 5 {
		insertN(t, s.DB, "orders", "m"+string(rune('a'+i)))
	}
	rec := &recorder{behave: func(string, *message.Message) (bool, error) {
		return false, forwarder.MarkUnavailable(errBroker)
	}}
	var open, failed atomic.Int64
	var counting atomic.Bool
	f := newForwarder(t, s.DB, rec, forwarder.Config{
		BatchSize: 5, Concurrency: 1,
		PollInterval: 50 * time.Millisecond, MaxPollInterval: 200 * time.Millisecond,
		BackoffBase: 100 * time.Millisecond, BackoffMax: 200 * time.Millisecond,
		BreakerThreshold: 2, BreakerProbeBase: 10 * time.Millisecond, BreakerProbeMax: 20 * time.Millisecond,
		DBTimeout: time.Second,
		OnReport: func(r forwarder.Report) {
			if len(r.OpenBreakers) > 0 {
				open.Add(1)
			}
			if counting.Load() && r.ClaimFailures > 0 {
				failed.Add(1)
			}
		},
	})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	await.Until(t, func() bool { return open.Load() > 0 }, "the breaker never opened")

	// The database refuses every claim from now on.
	_, err := s.DB.Exec(`ALTER TABLE messaging_outbox RENAME TO messaging_outbox_away`)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = s.DB.Exec(`ALTER TABLE messaging_outbox_away RENAME TO messaging_outbox`) })
	counting.Store(true)
	start := time.Now()
	const watch = time.Second
	await.Until(t, func() bool { return time.Since(start) >= watch }, "the watch window of refused claims passes")
	n := failed.Load()
	cancel()
	_ = waitOrFail(t, done, "Run to return")
	// At most one failing pass per BackoffBase, with room for a slow machine.
	require.LessOrEqual(t, n, int64(2*watch/(100*time.Millisecond)),
		"%d failing passes in %s: Run retries a failing claim at once while a breaker probe is due", n, watch)
}

// While claims are paused (more publishes left behind than MaxAbandoned) a
// pass claims nothing, and Run counts it as idle: the wait doubles towards
// MaxPollInterval, pass after paused pass. A paused pass is not an idle
// outbox (it did not look), so once the hanging publishes return the relay
// still sleeps out the grown wait, with its backlog untouched: up to
// MaxPollInterval after the downstream recovered (18c08c1 took away the
// due probe that used to cut it, which spun). Here the hang ends right
// after a paused pass 3 s into the pause (an idle wait grown since is at
// least 1.5 s); the relay should resume within a second (PollInterval is
// 50 ms), not seconds later.
func TestPausedClaimsResumeSoonAfterTheHangEnds(t *testing.T) {
	s := newDB(t)
	for i := range 20 {
		insertN(t, s.DB, "orders", fmt.Sprintf("m%02d", i))
	}
	h := &hangCounter{release: make(chan struct{})}
	var once sync.Once
	t.Cleanup(func() { once.Do(func() { close(h.release) }) })
	var firstPause, releasedAt, resumedAt atomic.Int64
	f := newForwarder(t, s.DB, h, forwarder.Config{
		BatchSize: 1, Concurrency: 1, MaxAbandoned: 1,
		PublishTimeout: 20 * time.Millisecond, LeaseDuration: time.Second, DrainTimeout: 20 * time.Millisecond,
		PollInterval: 50 * time.Millisecond, MaxPollInterval: 20 * time.Second,
		OnReport: func(r forwarder.Report) {
			now := time.Now().UnixNano()
			switch {
			case r.ClaimPaused && releasedAt.Load() == 0:
				// Paused for 3 s: the idle wait, had it grown, is 1.5 s or more now.
				if firstPause.CompareAndSwap(0, now); time.Duration(now-firstPause.Load()) >= 3*time.Second {
					releasedAt.Store(now)
					once.Do(func() { close(h.release) }) // the downstream recovers
				}
			case releasedAt.Load() != 0 && r.Published > 0:
				resumedAt.CompareAndSwap(0, now)
			}
		},
	})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	await.Until(t, func() bool { return releasedAt.Load() != 0 }, "claims never stayed paused for 3 s")
	await.Until(t, func() bool { return resumedAt.Load() != 0 }, "the relay never resumed")
	cancel()
	require.NoError(t, waitOrFail(t, done, "Run to return"))
	took := time.Duration(resumedAt.Load() - releasedAt.Load())
	require.Less(t, took, time.Second, "the relay resumed %s after the hang ended (PollInterval 50 ms): paused passes grew the idle wait", took)
}
