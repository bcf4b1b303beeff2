package forwarder_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/await"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// runBeating starts a relay on s whose heartbeat beats every 250 ms and
// whose passes follow each other within milliseconds, with its errors
// logged to the returned errLogger; done receives Run's result.
func runBeating(t *testing.T, s *testdb.Schema) (f *forwarder.Forwarder, rec *recorder, logs *errLogger, done chan error) {
	t.Helper()
	rec, logs = &recorder{}, &errLogger{}
	f, err := forwarder.New(s.DB, rec, logs, forwarder.Config{
		HeartbeatInterval: 250 * time.Millisecond, // each beat must finish within it: shorter, and a busy machine lapses it for good
		PollInterval:      5 * time.Millisecond, MaxPollInterval: 10 * time.Millisecond,
		BackoffBase: 5 * time.Millisecond, BackoffMax: 10 * time.Millisecond,
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = f.Close() })
	done = make(chan error, 1)
	go func() { done <- f.Run(context.Background()) }()
	waitOrFail(t, f.Running(), "Run reaching its loop")
	return f, rec, logs, done
}

// Once heartbeats have failed for longer than their lifetime, relaymode.Enable
// may switch the database to CDC: the relay must stop claiming until a
// heartbeat succeeds again.
func TestRelayClaimsNothingWhileItsHeartbeatHasLapsed(t *testing.T) {
	s := newDB(t)
	f, rec, logs, done := runBeating(t, s)

	// Heartbeats now hang on the lock until their timeout: they fail.
	tx, err := s.DB.Begin()
	require.NoError(t, err)
	defer func() { _ = tx.Rollback() }()
	_, err = tx.Exec(`LOCK TABLE messaging_relay_heartbeat IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)
	await.Until(t, func() bool { return logs.count(forwarder.CodeHeartbeatLapsed) > 0 }, "passes fail with FORWARDER_HEARTBEAT_LAPSED")
	insertN(t, s.DB, "orders", "m1")
	n := logs.count(forwarder.CodeHeartbeatLapsed)
	await.Until(t, func() bool { return logs.count(forwarder.CodeHeartbeatLapsed) >= n+2 }, "two more passes fail with FORWARDER_HEARTBEAT_LAPSED")
	require.Empty(t, rec.ids(), "nothing is claimed while the heartbeat has lapsed")
	require.Equal(t, "PENDING", state(t, s.DB, "m1").Status)

	// A heartbeat succeeds again: claims resume.
	require.NoError(t, tx.Rollback())
	require.Eventually(t, func() bool { return len(rec.ids()) == 1 }, time.Minute, 5*time.Millisecond, "claims resume once a heartbeat succeeds (a minute: the machine may be busy)")
	require.NoError(t, f.Close())
	require.NoError(t, waitOrFail(t, done, "Run returning"))
}
