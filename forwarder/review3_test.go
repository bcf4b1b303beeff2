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
)

// With prefetch (Run's default) the claim made ahead starts right after the
// first claim, before any publish has returned, so nextSize still sees no
// measured pace (zero) and doubles again: Run claims 10, 20, then 40 rows
// against a downstream whose pace (20 ms a message, one at a time) lets a
// 2 s lease publish 500 ms / 20 ms = 25 of them, i.e. claims of at most 20
// (RunOnce keeps to it: TestClaimsDoNotOutgrowWhatTheLeaseCanPublish). The
// 40-row claim waits for the 20 ahead of it and most of it is released
// without an attempt once its start-by deadline passes.
func TestRunClaimsAheadDoNotGrowBeforeAnyPublishWasTimed(t *testing.T) {
	t.Parallel() // waits on its downstream's pace or on leases: overlaps the other parallel tests
	s := newDB(t)
	_, err := s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload)
		SELECT 'a' || g, 'orders', 'x' FROM generate_series(1, 300) g`)
	require.NoError(t, err)
	rec := &recorder{behave: func(string, *message.Message) (bool, error) {
		time.Sleep(20 * time.Millisecond) // the downstream's own pace, not a wait for an event
		return true, nil
	}}
	var maxClaimed, released atomic.Int64
	f := newForwarder(t, s.DB, rec, forwarder.Config{
		BatchSize: 10, MaxBatchSize: 1000, Concurrency: 1, LeaseDuration: 2 * time.Second, PublishTimeout: time.Second,
		OnReport: func(r forwarder.Report) {
			for {
				m := maxClaimed.Load()
				if int64(r.Claimed) <= m || maxClaimed.CompareAndSwap(m, int64(r.Claimed)) {
					break
				}
			}
			released.Add(int64(r.Released))
		},
	})
	runUntilDelivered(t, f, rec, 300, 60*time.Second)
	require.LessOrEqual(t, maxClaimed.Load(), int64(20),
		"a claim of %d rows, more than the lease can publish at the downstream's pace (%d rows released without an attempt)", maxClaimed.Load(), released.Load())
}

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
	require.Eventually(t, func() bool { return open.Load() > 0 }, 20*time.Second, 5*time.Millisecond, "the breaker never opened")

	// The database refuses every claim from now on.
	_, err := s.DB.Exec(`ALTER TABLE messaging_outbox RENAME TO messaging_outbox_away`)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = s.DB.Exec(`ALTER TABLE messaging_outbox_away RENAME TO messaging_outbox`) })
	counting.Store(true)
	start := time.Now()
	const watch = time.Second
	require.Eventually(t, func() bool { return time.Since(start) >= watch }, 10*time.Second, 5*time.Millisecond)
	n := failed.Load()
	cancel()
	_ = waitOrFail(t, done, "Run to return")
	// At most one failing pass per BackoffBase, with room for a slow machine.
	require.LessOrEqual(t, n, int64(2*watch/(100*time.Millisecond)),
		"%d failing passes in %s: Run retries a failing claim at once while a breaker probe is due", n, watch)
}

// A claim may grow while pace x size fits in a quarter of the lease, but no
// publish starts after the start-by deadline, LeaseDuration - 1.5 x
// PublishTimeout after the claim, which is only a quarter of the lease at
// the shortest lease Validate allows (2 x PublishTimeout); and with
// prefetch a batch claimed ahead first waits for the whole batch before it.
// Against a downstream taking at least 10 ms a message (one at a time, a 2 s
// lease, a 1 s PublishTimeout: start by 500 ms) a relay grew its claims
// from 5 to 40 rows (40 x 10 ms = 400 ms fits the quarter, 500 ms); each
// then waits about 400 ms for the one ahead, and part of every claim is
// released without an attempt, pass after pass: the growth makes the relay
// slower and churns leases. Twice a claim must fit the start-by window:
// 500 ms / (2 x 10 ms) = 25 rows at most (a slower machine only makes the
// pace slower and the claims smaller).
func TestClaimsDoNotGrowPastWhatTheStartByDeadlineLetsStart(t *testing.T) {
	t.Parallel() // waits on its downstream's pace or on leases: overlaps the other parallel tests
	s := newDB(t)
	_, err := s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload)
		SELECT 'a' || g, 'orders', 'x' FROM generate_series(1, 400) g`)
	require.NoError(t, err)
	rec := &recorder{behave: func(string, *message.Message) (bool, error) {
		time.Sleep(10 * time.Millisecond) // the downstream's own pace, not a wait for an event
		return true, nil
	}}
	var released, maxClaimed atomic.Int64
	f := newForwarder(t, s.DB, rec, forwarder.Config{
		BatchSize: 5, MaxBatchSize: 1000, Concurrency: 1, LeaseDuration: 2 * time.Second, PublishTimeout: time.Second,
		OnReport: func(r forwarder.Report) {
			for {
				m := maxClaimed.Load()
				if int64(r.Claimed) <= m || maxClaimed.CompareAndSwap(m, int64(r.Claimed)) {
					break
				}
			}
			released.Add(int64(r.Released))
		},
	})
	runUntilDelivered(t, f, rec, 400, 60*time.Second)
	require.LessOrEqual(t, maxClaimed.Load(), int64(25), "a claim of %d rows: twice that at 10 ms a message overruns the 500 ms start-by window (%d rows released without an attempt)",
		maxClaimed.Load(), released.Load())
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
	require.Eventually(t, func() bool { return releasedAt.Load() != 0 }, 30*time.Second, 5*time.Millisecond, "claims never stayed paused for 3 s")
	require.Eventually(t, func() bool { return resumedAt.Load() != 0 }, 30*time.Second, 5*time.Millisecond, "the relay never resumed")
	cancel()
	require.NoError(t, waitOrFail(t, done, "Run to return"))
	took := time.Duration(resumedAt.Load() - releasedAt.Load())
	require.Less(t, took, time.Second, "the relay resumed %s after the hang ended (PollInterval 50 ms): paused passes grew the idle wait", took)
}

// The claim size follows the mean publish time over every destination, and
// a claim of size n holds at most n / Concurrency rows of one key while
// other rows fill it; but once they run out, a claim extends a key's chain
// to fill the whole batch. Behind many fast rows (an instant downstream)
// and one hot key on a slow one (10 ms a message), the mean says claims of
// a hundred rows and more fit the lease; when the fast rows run out the hot
// key's chain is extended to the whole claim and published one message at
// a time, at 10 ms, not at the mean: far past the start-by deadline (2.5 s
// after the claim: a 4 s lease, a 1 s PublishTimeout; a 1,000-row chain
// takes 10 s), so most of it is released without an attempt, claim after
// claim. A chain sized by the slow destination's own pace (a second's
// worth: 100 rows) fits. (The lease leaves the 1,000 fast rows of a batch
// seconds to spare on a loaded machine under -race.)
func TestAHotKeyOnASlowDestinationIsNotClaimedAtTheMeanPace(t *testing.T) {
	s := newDB(t)
	_, err := s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload)
		SELECT 'f' || g, 'fast', 'x' FROM generate_series(1, 3000) g`)
	require.NoError(t, err)
	_, err = s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload, ordering_key)
		SELECT 'h' || g, 'slow', 'x', 'hot' FROM generate_series(1, 300) g`)
	require.NoError(t, err)
	rec := &recorder{behave: func(topic string, _ *message.Message) (bool, error) {
		if topic == "slow" {
			time.Sleep(10 * time.Millisecond) // the downstream's own pace, not a wait for an event
		}
		return true, nil
	}}
	f := newForwarder(t, s.DB, rec, forwarder.Config{
		BatchSize: 8, MaxBatchSize: 1000, Concurrency: 8, LeaseDuration: 4 * time.Second, PublishTimeout: time.Second,
	})
	var released, claims int
	for range 1000 {
		rep, err := f.RunOnce(context.Background())
		require.NoError(t, err)
		released += rep.Released
		claims++
		if rep.Claimed == 0 {
			break
		}
	}
	require.Len(t, rec.ids(), 3300)
	require.Zero(t, released, "%d rows released without an attempt over %d claims: a hot key's chain outgrew the start-by deadline", released, claims)
}
