package cdcrelay_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/cdcrelay"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/await"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// Close returns within StopBound when every step of the stop runs into its
// timeout: a publish that does not return (left behind after DrainTimeout),
// the mark of the row published before it waiting on that row's lock, and
// the heartbeat's removal waiting on the heartbeat row's lock, both held by
// another transaction. Before StopBound, Close waited for the publish for as
// long as it took. What the stop could not do is done by the next relay.
func TestCloseReturnsWithinStopBound(t *testing.T) {
	base := testdb.Logical(t)
	e := newEnv(t, base)
	e.enableCDC(t)
	cfg := e.config()
	cfg.Owner = "cdc-stop-bound"
	cfg.DBTimeout, cfg.DrainTimeout = time.Second, time.Second
	out := newGate("second")
	t.Cleanup(out.release) // the publish left behind returns before the goroutine check

	r, err := cdcrelay.New(cfg, out, nil)
	require.NoError(t, err)
	runErr := make(chan error, 1)
	go func() { runErr <- r.Run(context.Background()) }()
	t.Cleanup(func() { _ = r.Close() })
	require.Eventually(t, func() bool { return e.walsenderStreaming(t) }, await.Patience(t), 10*time.Millisecond)

	// One transaction: "first" is published, "second" stays in the
	// downstream. The batch is marked once the whole transaction is
	// published, so "first" is not marked yet.
	e.publish(t, "orders", msg("first", "1", nil), msg("second", "2", nil))
	select {
	case <-out.entered:
	case <-time.After(await.Patience(t)):
		t.Fatal("the relay never published the second message")
	}
	require.Equal(t, []string{"first"}, out.ids())

	tx, err := e.s.DB.Begin()
	require.NoError(t, err)
	defer func() { _ = tx.Rollback() }()
	var id string
	require.NoError(t, tx.QueryRow(`SELECT message_id FROM messaging_outbox WHERE message_id = 'first' FOR UPDATE`).Scan(&id))
	require.NoError(t, tx.QueryRow(`SELECT owner FROM messaging_relay_heartbeat WHERE owner = $1 FOR UPDATE`, cfg.Owner).Scan(&id))

	bound := cfg.StopBound()
	began := time.Now()
	closed := make(chan error, 1)
	go func() { closed <- r.Close() }()
	select {
	case err = <-closed:
	case <-time.After(bound):
		t.Fatalf("Close had not returned %s (StopBound) after it was called", bound)
	}
	t.Logf("Close returned after %s (StopBound %s)", time.Since(began).Round(time.Millisecond), bound)
	require.LessOrEqual(t, time.Since(began), bound)
	require.NoError(t, err)
	require.NoError(t, receive(t, runErr), "a stop is clean, also when its writes time out")

	// The mark and the heartbeat's removal timed out on the locks.
	require.Equal(t, 0, e.s.Count(t, "status = 'PUBLISHED'"))
	var beats int
	require.NoError(t, e.s.DB.QueryRow(`SELECT count(*) FROM messaging_relay_heartbeat WHERE owner = $1`, cfg.Owner).Scan(&beats))
	require.Equal(t, 1, beats, "the heartbeat's removal waited on the lock until DBTimeout")

	// Nothing is lost: the transaction was not confirmed, so the next relay
	// streams it again and delivers both (the downstream may see them
	// twice: "first" was accepted, "second" is still in its publisher).
	require.NoError(t, tx.Rollback())
	out.release()
	wait := e.relay(t, cfg, out)
	require.Eventually(t, func() bool { return e.s.Count(t, "status = 'PUBLISHED'") == 2 }, await.Patience(t), 10*time.Millisecond)
	require.NoError(t, wait())
}
