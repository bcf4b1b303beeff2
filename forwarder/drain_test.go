package forwarder_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/forwarder"
)

// Cancelling Run's context drains the pass in progress exactly like Close:
// the publish already started gets DrainTimeout and is recorded AMBIGUOUS,
// the rows not yet started are released with no attempt spent, and the
// heartbeat is removed.
func TestCancellingRunDuringAPassLeavesNoRowInFlight(t *testing.T) {
	s := newDB(t)
	insertN(t, s.DB, "orders", "m1", "m2", "m3", "m4", "m5")
	h := newHanger(t)
	var mu sync.Mutex
	var reports []forwarder.Report
	f := newForwarder(t, s.DB, h, forwarder.Config{
		Owner: "cancelled", Concurrency: 1, PublishTimeout: 5 * time.Second, DrainTimeout: 100 * time.Millisecond,
		OnReport: func(r forwarder.Report) { mu.Lock(); reports = append(reports, r); mu.Unlock() },
	})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	runErr := make(chan error, 1)
	go func() { runErr <- f.Run(ctx) }()
	waitOrFail(t, f.Running(), "Run reaching its loop")
	require.Equal(t, "m1", waitOrFail(t, h.entered, "the first publish"))
	cancel()
	require.NoError(t, waitOrFail(t, runErr, "Run returning after its context was cancelled"))
	require.Zero(t, s.Count(t, "status = 'IN_FLIGHT' AND lease_owner = 'cancelled'"))
	require.Equal(t, "AMBIGUOUS", state(t, s.DB, "m1").Status, "the publish in progress is unknown")
	require.Equal(t, 4, s.Count(t, "status = 'PENDING' AND attempts = 0"), "the rest were released, no attempt spent")
	mu.Lock()
	require.Len(t, reports, 1)
	require.Equal(t, forwarder.Report{Claimed: 5, Ambiguous: 1, Released: 4}, withoutDuration(reports[0]))
	mu.Unlock()
	var beats int
	require.NoError(t, s.DB.QueryRow(`SELECT count(*) FROM messaging_relay_heartbeat WHERE owner = 'cancelled'`).Scan(&beats))
	require.Zero(t, beats, "cancelling Run removes the relay's heartbeat")
}

// RunOnce's doc: cancelling ctx drains the pass like Close does.
func TestCancellingRunOnceDuringAPassLeavesNoRowInFlight(t *testing.T) {
	s := newDB(t)
	insertN(t, s.DB, "orders", "m1", "m2", "m3", "m4", "m5")
	h := newHanger(t)
	f := newForwarder(t, s.DB, h, forwarder.Config{
		Owner: "once", Concurrency: 1, PublishTimeout: 5 * time.Second, DrainTimeout: 100 * time.Millisecond,
	})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	type result struct {
		rep forwarder.Report
		err error
	}
	done := make(chan result, 1)
	go func() {
		rep, err := f.RunOnce(ctx)
		done <- result{rep, err}
	}()
	require.Equal(t, "m1", waitOrFail(t, h.entered, "the first publish"))
	cancel()
	res := waitOrFail(t, done, "RunOnce returning after its context was cancelled")
	require.NoError(t, res.err)
	require.Equal(t, forwarder.Report{Claimed: 5, Ambiguous: 1, Released: 4}, withoutDuration(res.rep))
	require.Zero(t, s.Count(t, "status = 'IN_FLIGHT'"))
	require.Equal(t, "AMBIGUOUS", state(t, s.DB, "m1").Status, "the publish in progress is unknown")
	require.Equal(t, 4, s.Count(t, "status = 'PENDING' AND attempts = 0"), "the rest were released, no attempt spent")
}

// A RunOnce whose context is already cancelled may or may not claim (the
// stop signal is delivered concurrently), but whatever it claims it writes
// back: nothing stays IN_FLIGHT, and every claimed row is either published
// or released without spending an attempt.
func TestRunOnceWithACancelledContextLeavesNoRowInFlight(t *testing.T) {
	s := newDB(t)
	insertN(t, s.DB, "orders", "m1", "m2", "m3")
	rec := &recorder{}
	f := newForwarder(t, s.DB, rec, forwarder.Config{Owner: "precancelled", Concurrency: 1})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	for range 5 {
		rep, err := f.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, rep.Claimed, rep.Published+rep.Released, "every claimed row is published or released: %+v", rep)
		require.Zero(t, rep.Ambiguous+rep.Failed+rep.Exhausted+rep.Stale)
		require.Zero(t, s.Count(t, "status = 'IN_FLIGHT'"))
		require.Equal(t, len(rec.ids()), s.Count(t, "status = 'PUBLISHED'"))
		require.Equal(t, 3-len(rec.ids()), s.Count(t, "status = 'PENDING' AND attempts = 0"))
	}
}

// The Close and README promise: when the database is gone while the pass on
// the way out drains, its outcome write fails, and Run and Close both return
// that error (on main both returned nil with the rows left IN_FLIGHT).
func TestRunAndCloseReturnTheDrainsFailedOutcomeWrite(t *testing.T) {
	s := newDB(t)
	insertN(t, s.DB, "orders", "g1", "g2")
	relayDB := s.Open(t) // the relay's own pool, closed below: its database is gone
	h := newHanger(t)
	f, err := forwarder.New(relayDB, h, nil, forwarder.Config{
		Owner: "gone", Concurrency: 2, PublishTimeout: 5 * time.Second, DrainTimeout: 5 * time.Second,
	})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	runErr := make(chan error, 1)
	go func() { runErr <- f.Run(ctx) }()
	waitOrFail(t, f.Running(), "Run reaching its loop")
	waitOrFail(t, h.entered, "a first publish")
	waitOrFail(t, h.entered, "a second publish")
	require.NoError(t, relayDB.Close())
	cancel() // stop requested before the publishes end: this pass is the drain
	h.release <- struct{}{}
	h.release <- struct{}{}
	err = waitOrFail(t, runErr, "Run returning")
	require.ErrorIs(t, err, forwarder.ErrOutcomesNotWritten)
	require.ErrorIs(t, f.Close(), forwarder.ErrOutcomesNotWritten, "Close returns it too")
	require.Equal(t, 2, s.Count(t, "status = 'IN_FLIGHT' AND lease_owner = 'gone'"), "what the error says: the rows stay IN_FLIGHT")
}
