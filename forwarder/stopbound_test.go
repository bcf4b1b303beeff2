package forwarder_test

import (
	"context"
	"testing"
	"time"

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

	bound := f.Config().StopBound()
	began := time.Now()
	closed := make(chan error, 1)
	go func() { closed <- f.Close() }()
	select {
	case err = <-closed:
	case <-time.After(bound):
		t.Fatalf("Close had not returned %s (StopBound) after it was called", bound)
	}
	require.LessOrEqual(t, time.Since(began), bound)
	require.ErrorIs(t, err, forwarder.ErrOutcomesNotWritten, "the outcome write waited on the locked row until its timeout")
	require.ErrorIs(t, waitOrFail(t, runErr, "Run returning"), forwarder.ErrOutcomesNotWritten)
}
