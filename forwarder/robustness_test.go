package forwarder_test

import (
	"context"
	"database/sql"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/fencing"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// A pass may publish for up to LeaseDuration - 1.5 x PublishTimeout, far
// longer than the timeout of one statement: the outcome write must get its
// own timeout, not the one the claim started.
func TestOutcomesOfAPassLongerThanTheStatementTimeoutAreWritten(t *testing.T) {
	s := newDB(t)
	insertN(t, s.DB, "orders", "m1")
	const stmt = 100 * time.Millisecond
	// The publish itself is what takes long here (4 statement timeouts), so
	// waiting on a timer is the scenario, not a guess.
	var f *forwarder.Forwarder
	slow := &recorder{behave: func(string, *message.Message) (bool, error) {
		// The claim is done: from here on every statement gets stmt (the
		// claim itself keeps the default, so a busy machine cannot time
		// it out).
		forwarder.SetDBTimeout(f, stmt)
		<-time.After(4 * stmt)
		return true, nil
	}}
	f = newForwarder(t, s.DB, slow, forwarder.Config{PublishTimeout: 5 * time.Second})
	rep, err := f.RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, 1, rep.Published)
	require.Equal(t, "PUBLISHED", state(t, s.DB, "m1").Status)
}

// waitOrFail waits for ch, failing the test (instead of hanging it) when
// the thing it signals does not happen within a generous bound.
func waitOrFail[T any](t *testing.T, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(20 * time.Second):
		t.Fatalf("%s did not happen within 20s", what)
		panic("unreachable")
	}
}

// lib/pq's Listener.Listen waits for a connection, forever when the LISTEN
// server is unreachable: the relay must poll anyway, and Close must return.
func TestUnreachableListenURLNeitherBlocksRunNorClose(t *testing.T) {
	s := newDB(t)
	insertN(t, s.DB, "orders", "m1")
	rec := &recorder{}
	f := newForwarder(t, s.DB, rec, forwarder.Config{
		ListenURL:    "postgres://postgres@127.0.0.1:1/test?sslmode=disable&connect_timeout=1",
		PollInterval: 10 * time.Millisecond, MaxPollInterval: 20 * time.Millisecond,
	})
	done := make(chan error, 1)
	go func() { done <- f.Run(context.Background()) }()
	waitOrFail(t, f.Running(), "Run reaching its loop")
	require.Eventually(t, func() bool { return len(rec.ids()) == 1 }, 10*time.Second, 5*time.Millisecond, "polling relays the row")
	insertN(t, s.DB, "orders", "m2")
	require.Eventually(t, func() bool { return len(rec.ids()) == 2 }, 10*time.Second, 5*time.Millisecond, "polling keeps relaying")
	closed := make(chan error, 1)
	go func() { closed <- f.Close() }()
	require.NoError(t, waitOrFail(t, closed, "Close returning"))
	require.NoError(t, waitOrFail(t, done, "Run returning"))
	require.Equal(t, "PUBLISHED", state(t, s.DB, "m2").Status)
}

// An AMBIGUOUS row at 7 attempts after MaxAttempts was lowered to 5 is
// parked and reported by the next pass, not left waiting forever.
func TestRowOverALoweredBudgetIsReportedExhausted(t *testing.T) {
	s := newDB(t)
	insertN(t, s.DB, "orders", "m1")
	_, err := s.DB.Exec(`UPDATE messaging_outbox SET status = 'AMBIGUOUS', attempts = 7 WHERE message_id = 'm1'`)
	require.NoError(t, err)
	rec := &recorder{}
	f := newForwarder(t, s.DB, rec, forwarder.Config{MaxAttempts: 5})
	rep, err := f.RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, 1, rep.Exhausted)
	require.Empty(t, rec.ids())
	st := state(t, s.DB, "m1")
	require.Equal(t, "EXHAUSTED", st.Status)
	require.Equal(t, fencing.CodeBudgetSpent, st.Code)
}

// The database clock runs an hour ahead of this host's (simulated: a
// schema-local now() shadows pg_catalog's for connections whose search_path
// puts the schema first). The retry delay must still count from the clock
// the claim compares with, not from the host's.
func TestRetryBackoffIgnoresHostClockSkew(t *testing.T) {
	s := newDB(t)
	_, err := s.DB.Exec(`CREATE FUNCTION ` + s.Name + `.now() RETURNS timestamptz LANGUAGE sql STABLE
		AS $$ SELECT pg_catalog.now() + interval '1 hour' $$`)
	require.NoError(t, err)
	skewed, err := sql.Open("postgres", testdb.WithSearchPath(testdb.URL(), s.Name+",pg_catalog"))
	require.NoError(t, err)
	skewed.SetMaxOpenConns(4)
	t.Cleanup(func() { _ = skewed.Close() })
	var ahead bool
	require.NoError(t, skewed.QueryRow(`SELECT now() > pg_catalog.now() + interval '59 minutes'`).Scan(&ahead))
	require.True(t, ahead, "the skewed connection sees the shifted clock")

	insertN(t, s.DB, "orders", "m1")
	failing := &recorder{behave: func(string, *message.Message) (bool, error) { return false, errBroker }}
	f := newForwarder(t, skewed, failing, forwarder.Config{BackoffBase: time.Minute, BackoffMax: time.Hour})
	rep, err := f.RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, 1, rep.Ambiguous)
	delay := f.RetryDelay("m1", 1)

	// last_attempt_at was written by the claim on the database clock; the
	// retry is due the delay after it (plus the pass's own duration).
	var us int64
	require.NoError(t, s.DB.QueryRow(`SELECT (extract(epoch FROM next_attempt_at - last_attempt_at) * 1000000)::int8
		FROM messaging_outbox WHERE message_id = 'm1'`).Scan(&us))
	gap := time.Duration(us) * time.Microsecond
	require.GreaterOrEqual(t, gap, delay)
	require.Less(t, gap, delay+10*time.Second)

	// And the backoff holds: the next pass does not take the row again.
	rep, err = f.RunOnce(context.Background())
	require.NoError(t, err)
	require.Zero(t, rep.Claimed)
}

// gate blocks every Publish until open is closed, and reports each entry.
type gate struct {
	entered chan string
	open    chan struct{}
}

func (g *gate) Publish(_ string, msgs ...*message.Message) error {
	g.entered <- msgs[0].UUID
	<-g.open
	return nil
}

func (g *gate) Close() error { return nil }

// The pass that releases a batch claimed ahead runs after the loop ended; if
// its write fails, the rows stay IN_FLIGHT, and Run must say so.
func TestFailedFinalReleaseIsReturnedByRun(t *testing.T) {
	s := newDB(t)
	insertN(t, s.DB, "orders", "m1", "m2")
	fdb := s.Open(t) // the relay's own pool, closed under it below
	fdb.SetMaxOpenConns(4)
	g := &gate{entered: make(chan string, 10), open: make(chan struct{})}
	logs := &errLogger{}
	f, err := forwarder.New(fdb, g, logs, forwarder.Config{
		BatchSize: 1, BackoffBase: time.Hour, BackoffMax: time.Hour, PollInterval: time.Hour, MaxPollInterval: time.Hour,
	})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	require.Equal(t, "m1", waitOrFail(t, g.entered, "the first publish"))
	// A full batch of one: m2 is claimed ahead while m1 is published.
	require.Eventually(t, func() bool { return state(t, s.DB, "m2").Status == "IN_FLIGHT" }, 10*time.Second, 5*time.Millisecond)
	require.NoError(t, fdb.Close())
	cancel()
	close(g.open)
	err = waitOrFail(t, done, "Run returning")
	require.Error(t, err)
	require.Contains(t, err.Error(), "release the batch claimed ahead")
	require.Contains(t, err.Error(), "database is closed")
	require.Equal(t, "IN_FLIGHT", state(t, s.DB, "m2").Status, "what the error reports")
	// m1 was published but its outcome could not be written: the log names
	// it with its lease token (a possible duplicate), and so does the m2
	// release that failed.
	require.Equal(t, "IN_FLIGHT", state(t, s.DB, "m1").Status)
	logs.mu.Lock()
	defer logs.mu.Unlock()
	var unwritten []string
	for _, fields := range logs.fields {
		if ids, ok := fields["message_ids"].([]string); ok {
			tokens := fields["lease_tokens"].([]int64)
			require.Equal(t, []int64{1}, tokens)
			unwritten = append(unwritten, ids...)
		}
	}
	require.Equal(t, []string{"m1", "m2"}, unwritten)
}

// A claim made ahead that a lapsed heartbeat refused took no row: Close
// logs it as a failed pass and does not report a failed release (seen in
// CI on a busy machine: Close returned "release the batch claimed ahead:
// release failed: FORWARDER_HEARTBEAT_LAPSED" with nothing left IN_FLIGHT).
func TestRefusedClaimAheadIsNotAFailedRelease(t *testing.T) {
	t.Parallel() // waits on its downstream's pace or on leases: overlaps the other parallel tests
	s := newDB(t)
	insertN(t, s.DB, "orders", "m1", "m2", "m3")
	g := &gate{entered: make(chan string, 10), open: make(chan struct{}, 10)} // one publish per token sent on open
	logs := &errLogger{}
	f, err := forwarder.New(s.DB, g, logs, forwarder.Config{
		Owner: "relay-a", BatchSize: 1, HeartbeatInterval: 250 * time.Millisecond, DBTimeout: 2 * time.Second,
		BackoffBase: time.Hour, BackoffMax: time.Hour, PollInterval: time.Hour, MaxPollInterval: time.Hour,
	})
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- f.Run(context.Background()) }()
	require.Equal(t, "m1", waitOrFail(t, g.entered, "the first publish"))
	// m2 was claimed ahead when m1's pass began, with the heartbeat alive.
	require.Eventually(t, func() bool { return state(t, s.DB, "m2").Status == "IN_FLIGHT" }, 10*time.Second, 5*time.Millisecond)

	// The relay's heartbeat row is locked: its beats wait and fail. Once the
	// last one that succeeded is older than its lifetime (3 x 250 ms), on the
	// database's clock (the relay measures from before it sent it), the
	// heartbeat has lapsed.
	tx, err := s.DB.Begin()
	require.NoError(t, err)
	defer func() { _ = tx.Rollback() }()
	_, err = tx.Exec(`SELECT 1 FROM messaging_relay_heartbeat WHERE owner = 'relay-a' FOR UPDATE`)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		var lapsed bool
		require.NoError(t, s.DB.QueryRow(`SELECT clock_timestamp() - heartbeat_at > interval '750 ms'
			FROM messaging_relay_heartbeat WHERE owner = 'relay-a'`).Scan(&lapsed))
		return lapsed
	}, time.Minute, 10*time.Millisecond)

	// m1 goes out; m2's pass begins and claims ahead: refused.
	g.open <- struct{}{}
	require.Equal(t, "m2", waitOrFail(t, g.entered, "the second publish"))
	closed := make(chan error, 1)
	go func() { closed <- f.Close() }()
	g.open <- struct{}{}
	require.NoError(t, waitOrFail(t, closed, "Close returning"), "the refused claim held nothing to release")
	require.NoError(t, waitOrFail(t, done, "Run returning"))
	require.Positive(t, logs.count(forwarder.CodeHeartbeatLapsed), "the claim ahead was refused, and logged")
	require.Equal(t, "PENDING", state(t, s.DB, "m3").Status, "the refused claim took nothing")
	require.Equal(t, "PUBLISHED", state(t, s.DB, "m2").Status)
}

// errLogger records the errors logged, for assertions on their codes.
type errLogger struct {
	watermill.NopLogger
	mu     sync.Mutex
	errs   []error
	fields []watermill.LogFields
}

func (l *errLogger) Error(_ string, err error, fields watermill.LogFields) {
	l.mu.Lock()
	l.errs = append(l.errs, err)
	l.fields = append(l.fields, fields)
	l.mu.Unlock()
}

func (l *errLogger) With(watermill.LogFields) watermill.LoggerAdapter { return l }

func (l *errLogger) count(code outbox.Code) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, err := range l.errs {
		if outbox.CodeOf(err) == code {
			n++
		}
	}
	return n
}

// Once heartbeats have failed for longer than their lifetime, relaymode.Enable
// may switch the database to CDC: the relay must stop claiming until a
// heartbeat succeeds again.
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

func TestRelayClaimsNothingWhileItsHeartbeatHasLapsed(t *testing.T) {
	s := newDB(t)
	f, rec, logs, done := runBeating(t, s)

	// Heartbeats now hang on the lock until their timeout: they fail.
	tx, err := s.DB.Begin()
	require.NoError(t, err)
	defer func() { _ = tx.Rollback() }()
	_, err = tx.Exec(`LOCK TABLE messaging_relay_heartbeat IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)
	require.Eventually(t, func() bool { return logs.count(forwarder.CodeHeartbeatLapsed) > 0 }, 10*time.Second, 5*time.Millisecond,
		"passes fail with FORWARDER_HEARTBEAT_LAPSED")
	insertN(t, s.DB, "orders", "m1")
	n := logs.count(forwarder.CodeHeartbeatLapsed)
	require.Eventually(t, func() bool { return logs.count(forwarder.CodeHeartbeatLapsed) >= n+2 }, 10*time.Second, 5*time.Millisecond)
	require.Empty(t, rec.ids(), "nothing is claimed while the heartbeat has lapsed")
	require.Equal(t, "PENDING", state(t, s.DB, "m1").Status)

	// A heartbeat succeeds again: claims resume.
	require.NoError(t, tx.Rollback())
	require.Eventually(t, func() bool { return len(rec.ids()) == 1 }, time.Minute, 5*time.Millisecond, "claims resume once a heartbeat succeeds (a minute: the machine may be busy)")
	require.NoError(t, f.Close())
	require.NoError(t, waitOrFail(t, done, "Run returning"))
}
