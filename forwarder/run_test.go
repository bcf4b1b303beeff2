package forwarder_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/await"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
)

func TestHeartbeatRenewsAndACDCSwitchStopsTheRelay(t *testing.T) {
	s := newDB(t)
	f := newForwarder(t, s.DB, &recorder{}, forwarder.Config{
		Owner: "beating", HeartbeatInterval: 250 * time.Millisecond, // each beat must finish within it, also on a busy machine
		PollInterval: time.Hour, MaxPollInterval: time.Hour,
	})
	done := make(chan error, 1)
	go func() { done <- f.Run(context.Background()) }()
	<-f.Running()
	var first time.Time
	require.NoError(t, s.DB.QueryRow(`SELECT heartbeat_at FROM messaging_relay_heartbeat WHERE owner = 'beating'`).Scan(&first))
	await.Until(t, func() bool {
		var last time.Time
		require.NoError(t, s.DB.QueryRow(`SELECT heartbeat_at FROM messaging_relay_heartbeat WHERE owner = 'beating'`).Scan(&last))
		return last.After(first)
	}, "the heartbeat is renewed")

	// Someone forces the database into CDC mode behind the relay's back (the
	// supported switch refuses while heartbeats are fresh): the next beat
	// sees it and the relay stops instead of racing the connector.
	_, err := s.DB.Exec(`UPDATE messaging_relay_mode SET mode = 'CDC'`)
	require.NoError(t, err)
	require.ErrorIs(t, <-done, relaymode.ErrRelayModeConflict)
}

func TestFullBatchesArePolledAgainAtOnce(t *testing.T) {
	s := newDB(t)
	for i := range 7 {
		insertN(t, s.DB, "orders", fmt.Sprintf("m%d", i))
	}
	rec := &recorder{}
	var mu sync.Mutex
	var claimed []int
	f := newForwarder(t, s.DB, rec, forwarder.Config{
		BatchSize: 2, PollInterval: time.Hour, MaxPollInterval: time.Hour,
		OnReport: func(r forwarder.Report) { mu.Lock(); claimed = append(claimed, r.Claimed); mu.Unlock() },
	})
	done := make(chan error, 1)
	go func() { done <- f.Run(context.Background()) }()
	// With an hour between polls, only the full-batch rule can get all seven
	// rows out.
	await.Until(t, func() bool { return len(rec.ids()) == 7 }, "all seven rows are delivered")
	// The short batch was claimed ahead, while its predecessor was in
	// flight, so one fresh claim (finding nothing) follows it before the
	// relay idles for an hour.
	await.Until(t, func() bool { mu.Lock(); defer mu.Unlock(); return len(claimed) == 5 }, "five claims are reported")
	require.NoError(t, f.Close())
	require.NoError(t, <-done)
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, []int{2, 2, 2, 1, 0}, claimed)
}

// barrier confirms a publish only when n publishes are inside Publish at
// the same time, so it proves concurrency without timing guesses.
type barrier struct {
	mu      sync.Mutex
	inside  int
	release chan struct{}
	n       int
}

func (b *barrier) Publish(string, ...*message.Message) error {
	b.mu.Lock()
	b.inside++
	if b.inside == b.n {
		close(b.release)
	}
	b.mu.Unlock()
	<-b.release
	return nil
}

func (b *barrier) Close() error { return nil }

func TestUnkeyedRowsArePublishedConcurrently(t *testing.T) {
	s := newDB(t)
	insertN(t, s.DB, "orders", "a", "b", "c")
	b := &barrier{n: 3, release: make(chan struct{})}
	f := newForwarder(t, s.DB, b, forwarder.Config{Concurrency: 3, PublishTimeout: 5 * time.Second})
	rep, err := f.RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, 3, rep.Published)
}

// captureLogger records log entries for assertions on field names.
type captureLogger struct {
	mu      sync.Mutex
	entries []logEntry
	fields  watermill.LogFields
}

type logEntry struct {
	level, msg string
	fields     watermill.LogFields
}

func (l *captureLogger) add(level, msg string, fields watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.entries = append(l.entries, logEntry{level, msg, l.fields.Add(fields)})
}
func (l *captureLogger) Error(msg string, _ error, f watermill.LogFields) { l.add("error", msg, f) }
func (l *captureLogger) Info(msg string, f watermill.LogFields)           { l.add("info", msg, f) }
func (l *captureLogger) Debug(msg string, f watermill.LogFields)          { l.add("debug", msg, f) }
func (l *captureLogger) Trace(msg string, f watermill.LogFields)          { l.add("trace", msg, f) }
func (l *captureLogger) Warn(msg string, f watermill.LogFields)           { l.add("warn", msg, f) }
func (l *captureLogger) With(f watermill.LogFields) watermill.LoggerAdapter {
	return &childLogger{parent: l, fields: l.fields.Add(f)}
}

type childLogger struct {
	parent *captureLogger
	fields watermill.LogFields
}

func (c *childLogger) Error(msg string, _ error, f watermill.LogFields) {
	c.parent.add("error", msg, c.fields.Add(f))
}
func (c *childLogger) Info(msg string, f watermill.LogFields) {
	c.parent.add("info", msg, c.fields.Add(f))
}
func (c *childLogger) Debug(msg string, f watermill.LogFields) {
	c.parent.add("debug", msg, c.fields.Add(f))
}
func (c *childLogger) Trace(msg string, f watermill.LogFields) {
	c.parent.add("trace", msg, c.fields.Add(f))
}
func (c *childLogger) With(f watermill.LogFields) watermill.LoggerAdapter {
	return &childLogger{parent: c.parent, fields: c.fields.Add(f)}
}

func TestStaleWriteIsLoggedAtWarnWithTheLease(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	clk := newClock()
	insertN(t, s.DB, "orders", "m1")
	fB := newForwarder(t, s.DB, &recorder{}, forwarder.Config{Owner: "relay-b", Now: clk.Now})
	recA := &recorder{behave: func(string, *message.Message) (bool, error) {
		clk.Advance(time.Minute)
		_, err := fB.RunOnce(ctx)
		require.NoError(t, err)
		return true, nil
	}}
	logs := &captureLogger{}
	fA, err := forwarder.New(s.DB, recA, logs, forwarder.Config{Owner: "relay-a", Now: clk.Now})
	require.NoError(t, err)
	t.Cleanup(func() { _ = fA.Close() })
	rep, err := fA.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, rep.Stale)
	logs.mu.Lock()
	defer logs.mu.Unlock()
	var found bool
	for _, e := range logs.entries {
		if e.level == "warn" {
			found = true
			require.Equal(t, "m1", e.fields["message_id"])
			require.Equal(t, "relay-a", e.fields["owner"])
			require.Equal(t, int64(1), e.fields["lease_token"])
		}
	}
	require.True(t, found, "stale write logged at warn: %v", logs.entries)
}

func TestRowWhoseExpiredLeaseSpentTheBudgetIsReportedExhausted(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	clk := newClock()
	insertN(t, s.DB, "orders", "m1")
	// A relay claimed the row and died mid-publish (its lease runs to t0+30s).
	_, err := s.DB.Exec(`UPDATE messaging_outbox SET status = 'IN_FLIGHT', lease_owner = 'dead', lease_token = 1,
		lease_expires_at = $1 WHERE message_id = 'm1'`, t0.Add(30*time.Second))
	require.NoError(t, err)
	rec := &recorder{}
	f := newForwarder(t, s.DB, rec, forwarder.Config{Now: clk.Now, MaxAttempts: 1})
	clk.Advance(time.Minute)
	rep, err := f.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, rep.Claimed)
	require.Equal(t, 1, rep.Exhausted)
	require.Empty(t, rec.ids(), "an exhausted row is reported, not published")
	require.Equal(t, "EXHAUSTED", state(t, s.DB, "m1").Status)
}

func TestNoPublishStartsThatCouldOutliveTheLease(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	clk := newClock()
	insertN(t, s.DB, "orders", "m1", "m2")
	// The first publish takes (on the injected clock) most of the lease: the
	// second row must not be started, but released for another pass.
	rec := &recorder{behave: func(string, *message.Message) (bool, error) {
		clk.Advance(23 * time.Second) // past 30s - 5s timeout - 2.5s write margin
		return true, nil
	}}
	f := newForwarder(t, s.DB, rec, forwarder.Config{
		Now: clk.Now, Concurrency: 1, LeaseDuration: 30 * time.Second, PublishTimeout: 5 * time.Second,
	})
	rep, err := f.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, rep.Published)
	require.Equal(t, 1, rep.Released)
	require.Equal(t, []string{"m1"}, rec.ids())
	require.Equal(t, "PENDING", state(t, s.DB, "m2").Status)
	require.Equal(t, 0, state(t, s.DB, "m2").Attempts, "a released row spent no attempt")
}

// Issue 18: under RouterPlugin a fatal error from Run (here the CDC switch a
// heartbeat finds) was only logged, and a router with other handlers ran on
// without a relay. Now the relay closes the router and RouterErr says why.
func TestRouterPluginClosesTheRouterOnAFatalRelayError(t *testing.T) {
	s := newDB(t)
	f := newForwarder(t, s.DB, &recorder{}, forwarder.Config{
		Owner: "router-fatal", HeartbeatInterval: 250 * time.Millisecond, // each beat must finish within it, also on a busy machine
		PollInterval: time.Hour, MaxPollInterval: time.Hour,
	})
	ps := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	t.Cleanup(func() { _ = ps.Close() })
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	r.AddPlugin(f.RouterPlugin())
	// Another handler: on its own the router would run on after the relay
	// stopped.
	r.AddConsumerHandler("other", "other-topic", ps, func(*message.Message) error { return nil })
	done := make(chan error, 1)
	go func() { done <- r.Run(context.Background()) }()
	<-f.Running()
	require.NoError(t, f.RouterErr(), "nil while the relay runs")

	_, err = s.DB.Exec(`UPDATE messaging_relay_mode SET mode = 'CDC'`)
	require.NoError(t, err)
	select {
	case err := <-done:
		require.NoError(t, err, "watermill's Router.Run returns nil after a Close")
	case <-time.After(time.Minute): // the next beat sees the switch: a minute leaves room for a busy machine
		require.NoError(t, r.Close())
		<-done
		t.Fatal("the router still ran after the relay stopped with RELAY_MODE_CONFLICT")
	}
	require.True(t, r.IsClosed())
	require.ErrorIs(t, f.RouterErr(), relaymode.ErrRelayModeConflict)
	require.Equal(t, outbox.Code("RELAY_MODE_CONFLICT"), outbox.CodeOf(f.RouterErr()))
}
