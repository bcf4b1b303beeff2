package forwarder_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/forwarder"
)

func TestStopBoundAddsUpTheStopsTimeouts(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name string
		cfg  forwarder.Config
		want time.Duration
	}{
		// Defaults: DrainTimeout = PublishTimeout, DBTimeout = min(15s, LeaseDuration/2).
		{"defaults", forwarder.Config{}, forwarder.DefaultPublishTimeout + 5*min(forwarder.DefaultDBTimeout, forwarder.DefaultLeaseDuration/2)},
		{"drain and writes", forwarder.Config{LeaseDuration: 8 * time.Second, PublishTimeout: time.Second, DrainTimeout: time.Second,
			DBTimeout: 2 * time.Second, HeartbeatInterval: time.Second}, time.Second + 4*2*time.Second + 2*time.Second},
		{"a heartbeat longer than the drain", forwarder.Config{LeaseDuration: 8 * time.Second, PublishTimeout: time.Second,
			DBTimeout: time.Second, HeartbeatInterval: time.Minute}, time.Minute + time.Second},
		{"lanes renew after the heartbeat", forwarder.Config{LeaseDuration: 8 * time.Second, PublishTimeout: time.Second,
			DBTimeout: time.Second, HeartbeatInterval: time.Minute, Fence: forwarder.FenceLanes}, time.Minute + 2*time.Second},
		{"DBTimeout from a short lease", forwarder.Config{LeaseDuration: 4 * time.Second, PublishTimeout: time.Second,
			HeartbeatInterval: time.Second}, time.Second + 4*2*time.Second + 2*time.Second},
	} {
		require.NoError(t, c.cfg.Validate(), c.name)
		require.Equal(t, c.want, c.cfg.StopBound(), c.name)
	}
}

// Close returns within StopBound when the stop's writes run into their
// timeouts: a publish that never returns (the drain expires), an outcome
// write and the heartbeat's removal each waiting on a row another session
// holds locked.
func TestCloseReturnsWithinStopBoundWhenItsWritesTimeOut(t *testing.T) {
	s := newDB(t)
	insertN(t, s.DB, "orders", "m1")
	h := newHanger(t)
	cfg := forwarder.Config{Owner: "bounded", Concurrency: 1, LeaseDuration: 4 * time.Second, PublishTimeout: time.Second,
		DrainTimeout: 200 * time.Millisecond, DBTimeout: 300 * time.Millisecond, HeartbeatInterval: 200 * time.Millisecond}
	f := newForwarder(t, s.DB, h, cfg)
	runErr := make(chan error, 1)
	go func() { runErr <- f.Run(context.Background()) }()
	waitOrFail(t, f.Running(), "Run reaching its loop")
	require.Equal(t, "m1", waitOrFail(t, h.entered, "the publish"))

	tx, err := s.DB.Begin()
	require.NoError(t, err)
	defer func() { _ = tx.Rollback() }()
	var n int
	require.NoError(t, tx.QueryRow(`SELECT count(*) FROM (SELECT 1 FROM messaging_outbox WHERE message_id = 'm1' FOR UPDATE) l`).Scan(&n))
	require.Equal(t, 1, n)
	require.NoError(t, tx.QueryRow(`SELECT count(*) FROM (SELECT 1 FROM messaging_relay_heartbeat WHERE owner = 'bounded' FOR UPDATE) l`).Scan(&n))
	require.Equal(t, 1, n)

	err = closeWithinStopBound(t, f)
	require.ErrorIs(t, err, forwarder.ErrOutcomesNotWritten, "the outcome write waited on the locked row until its timeout")
	require.ErrorIs(t, waitOrFail(t, runErr, "Run returning"), forwarder.ErrOutcomesNotWritten)
}

// failAfter holds every publish until release is closed, then refuses it
// with errBroker: the same ambiguous failure on every destination.
type failAfter struct {
	entered chan string
	release chan struct{}
}

func (p *failAfter) Publish(_ string, msgs ...*message.Message) error {
	p.entered <- msgs[0].UUID
	<-p.release
	return errBroker
}

func (p *failAfter) Close() error { return nil }

// The breaker changes of a pass are written under one deadline, however
// many destinations change: StopBound counts them once. Twelve
// destinations' breakers open in the pass that the stop ends (every publish
// of the pass failed the same way), and each breaker row's INSERT waits on
// a row another transaction inserted and holds uncommitted; written one
// after the other with a DBTimeout each they took 12 x DBTimeout, far more
// than StopBound.
func TestCloseReturnsWithinStopBoundWhenManyBreakersChange(t *testing.T) {
	s := newDB(t)
	const dests = 12
	for d := range dests {
		insertN(t, s.DB, fmt.Sprintf("dest%02d", d), fmt.Sprintf("m%02da", d), fmt.Sprintf("m%02db", d))
	}
	p := &failAfter{entered: make(chan string, 2*dests), release: make(chan struct{})}
	var once sync.Once
	release := func() { once.Do(func() { close(p.release) }) }
	t.Cleanup(release)
	// Every row in flight at once; no breaker opens on a single failure
	// (the threshold), so the pass's evidence opens them all together.
	// DBTimeout leaves the pass's outcome write room on a busy host (at
	// 300 ms it once timed out during `make test`, every suite running);
	// StopBound (6 s) stays below 12 x DBTimeout.
	cfg := forwarder.Config{Owner: "bounded-breakers", Concurrency: 2 * dests, BatchSize: 2 * dests, BreakerThreshold: 100,
		LeaseDuration: 8 * time.Second, PublishTimeout: time.Second, DrainTimeout: time.Second,
		DBTimeout: time.Second, HeartbeatInterval: 200 * time.Millisecond}
	f := newForwarder(t, s.DB, p, cfg)
	runErr := make(chan error, 1)
	go func() { runErr <- f.Run(context.Background()) }()
	waitOrFail(t, f.Running(), "Run reaching its loop")
	for range 2 * dests {
		waitOrFail(t, p.entered, "every publish of the pass")
	}

	// Run removed its owner's breaker rows at its start; rows inserted now,
	// uncommitted, make the relay's INSERT of each breaker row wait for
	// this transaction.
	tx, err := s.DB.Begin()
	require.NoError(t, err)
	defer func() { _ = tx.Rollback() }()
	for d := range dests {
		_, err := tx.Exec(`INSERT INTO messaging_relay_breaker (owner, destination, last_error) VALUES ('bounded-breakers', $1, 'held')`, fmt.Sprintf("dest%02d", d))
		require.NoError(t, err)
	}

	bound := f.Config().StopBound()
	require.Less(t, bound, dests*cfg.DBTimeout, "the test needs more destinations than StopBound has DBTimeouts")
	release() // every publish fails now: the pass opens the twelve breakers while the stop begins
	require.NoError(t, closeWithinStopBound(t, f))
	require.NoError(t, waitOrFail(t, runErr, "Run returning"))

	// The breakers did change in that pass: all twelve are open.
	ready := f.Ready()
	require.ErrorIs(t, ready, forwarder.ErrDownstreamUnavailable)
	for d := range dests {
		require.Contains(t, ready.Error(), fmt.Sprintf("dest%02d", d))
	}
	// Their rows are back without an attempt spent.
	require.NoError(t, tx.Rollback())
	var n int
	require.NoError(t, s.DB.QueryRow(`SELECT count(*) FROM messaging_outbox WHERE status = 'PENDING' AND attempts = 0`).Scan(&n))
	require.Equal(t, 2*dests, n)
}

// closeWithinStopBound closes f and returns Close's result, failing the test
// when Close has not returned within f's StopBound (the bound its
// configuration promises, not a measure of speed).
func closeWithinStopBound(t *testing.T, f *forwarder.Forwarder) error {
	t.Helper()
	bound := f.Config().StopBound()
	began := time.Now()
	closed := make(chan error, 1)
	go func() { closed <- f.Close() }()
	select {
	case err := <-closed:
		require.LessOrEqual(t, time.Since(began), bound)
		return err
	case <-time.After(bound):
		t.Fatalf("Close had not returned %s (StopBound) after it was called", bound)
		return nil
	}
}
