package forwarder_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/await"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// With prefetch on (the default), Run claims batch N+1 while batch N is
// published. A key's later row must still never go out before its earlier
// one: the earlier row is IN_FLIGHT while the next claim runs, so it blocks
// its key.
func TestPrefetchKeepsPerKeyOrder(t *testing.T) {
	s := newDB(t)
	const keys, perKey = 5, 8
	for i := range perKey {
		for k := range keys {
			m := message.NewMessage(fmt.Sprintf("k%d-%02d", k, i), []byte("x"))
			envelope.SetOrderingKey(m, fmt.Sprintf("key-%d", k))
			insert(t, s.DB, "orders", m)
		}
	}
	// Rows without a key fill the batches, so most claims are full and a
	// prefetch starts after them.
	for i := range 40 {
		insertN(t, s.DB, "orders", fmt.Sprintf("free-%02d", i))
	}
	rec := &recorder{}
	f := newForwarder(t, s.DB, rec, forwarder.Config{BatchSize: 3, PollInterval: 5 * time.Millisecond, MaxPollInterval: 10 * time.Millisecond})
	runUntilDelivered(t, f, rec, keys*perKey+40)

	next := map[string]int{}
	for _, id := range rec.ids() {
		var k, i int
		if _, err := fmt.Sscanf(id, "k%d-%d", &k, &i); err != nil {
			continue
		}
		key := fmt.Sprint(k)
		require.Equal(t, next[key], i, "key %d: row %d published out of order", k, i)
		next[key]++
	}
	var inFlight int
	require.NoError(t, s.DB.QueryRow(`SELECT count(*) FROM messaging_outbox WHERE status <> 'PUBLISHED'`).Scan(&inFlight))
	require.Zero(t, inFlight)
}

// A batch claimed ahead while Close is waiting for the current one is
// released, not published and not left IN_FLIGHT: its rows go back PENDING
// with no attempt counted, and the pass that released them says so.
func TestCloseReleasesThePrefetchedBatch(t *testing.T) {
	t.Parallel() // waits on leases, outages and processes: overlaps the other parallel tests
	s := newDB(t)
	insertN(t, s.DB, "orders", "a", "b", "c", "d")
	h := newHanger(t)
	var mu sync.Mutex
	var reports []forwarder.Report
	f := newForwarder(t, s.DB, h, forwarder.Config{
		// PublishTimeout long enough that "a" is still hanging when Close
		// comes, however slow the claim ahead is on a busy machine.
		Owner: "pf", BatchSize: 2, Concurrency: 1, PublishTimeout: 3 * time.Second,
		PollInterval: time.Hour, MaxPollInterval: time.Hour,
		OnReport: func(r forwarder.Report) { mu.Lock(); reports = append(reports, r); mu.Unlock() },
	})
	done := make(chan error, 1)
	go func() { done <- f.Run(context.Background()) }()
	require.Equal(t, "a", <-h.entered, "the first batch is being published")
	// While "a" hangs, the next batch (c, d) is claimed ahead: all four rows
	// are IN_FLIGHT under this relay.
	await.Until(t, func() bool {
		var n int
		require.NoError(t, s.DB.QueryRow(`SELECT count(*) FROM messaging_outbox WHERE status = 'IN_FLIGHT' AND lease_owner = 'pf'`).Scan(&n))
		return n == 4
	}, "the next batch is claimed while the current one publishes")

	require.NoError(t, f.Close())
	require.NoError(t, <-done)
	var n int
	require.NoError(t, s.DB.QueryRow(`SELECT count(*) FROM messaging_outbox WHERE status = 'IN_FLIGHT'`).Scan(&n))
	require.Zero(t, n, "Close leaves no row IN_FLIGHT")
	require.Equal(t, "AMBIGUOUS", state(t, s.DB, "a").Status, "the hanging publish timed out")
	for _, id := range []string{"b", "c", "d"} {
		st := state(t, s.DB, id)
		require.Equal(t, "PENDING", st.Status, id)
		require.Zero(t, st.Attempts, id)
	}
	mu.Lock()
	defer mu.Unlock()
	require.Len(t, reports, 2)
	require.Equal(t, forwarder.Report{Claimed: 2, Ambiguous: 1, Released: 1}, withoutDuration(reports[0]))
	// "a" hangs on (the hanger ignores its context): the pass that releases
	// the prefetched batch reports it as a publish left behind.
	require.Equal(t, forwarder.Report{Claimed: 2, Released: 2, AbandonedPublishes: 1}, withoutDuration(reports[1]), "the prefetched batch is reported as its own pass")
}

// With DisablePrefetch a relay holds one batch at a time.
func TestDisablePrefetchHoldsOneBatch(t *testing.T) {
	s := newDB(t)
	insertN(t, s.DB, "orders", "a", "b", "c", "d")
	h := newHanger(t)
	var mu sync.Mutex
	var reports []forwarder.Report
	f := newForwarder(t, s.DB, h, forwarder.Config{
		Owner: "nopf", BatchSize: 2, Concurrency: 1, PublishTimeout: 200 * time.Millisecond, DisablePrefetch: true,
		PollInterval: time.Hour, MaxPollInterval: time.Hour,
		OnReport: func(r forwarder.Report) { mu.Lock(); reports = append(reports, r); mu.Unlock() },
	})
	done := make(chan error, 1)
	go func() { done <- f.Run(context.Background()) }()
	require.Equal(t, "a", <-h.entered)
	require.NoError(t, f.Close())
	require.NoError(t, <-done)
	for _, id := range []string{"c", "d"} {
		st := state(t, s.DB, id)
		require.Equal(t, "PENDING", st.Status, id)
		require.Empty(t, st.Owner, "%s was never claimed", id)
	}
	mu.Lock()
	defer mu.Unlock()
	require.Len(t, reports, 1)
}

func withoutDuration(r forwarder.Report) forwarder.Report { r.Duration = 0; return r }

// With a full batch claimed ahead, Run publishes it while the previous
// batch's outcome statement is still running (pipelining), yet outcome
// statements commit one at a time in pass order, and Close waits for the
// last of them. Here batch 1's outcome statement waits on a row lock the
// test holds: batch 2 is published meanwhile, but its outcomes are not
// written before batch 1's, and no pass reports before its outcomes are in.
func TestOutcomesAreWrittenBehindTheNextBatch(t *testing.T) {
	s := newDB(t)
	insertN(t, s.DB, "orders", "a", "b", "c", "d")
	g := &gate{entered: make(chan string, 10), open: make(chan struct{})}
	var mu sync.Mutex
	var reports []forwarder.Report
	f := newForwarder(t, s.DB, g, forwarder.Config{
		Owner: "pl", BatchSize: 2, Concurrency: 1, PollInterval: time.Hour, MaxPollInterval: time.Hour,
		OnReport: func(r forwarder.Report) { mu.Lock(); reports = append(reports, r); mu.Unlock() },
	})
	done := make(chan error, 1)
	go func() { done <- f.Run(context.Background()) }()
	require.Equal(t, "a", waitOrFail(t, g.entered, "the first publish"))

	lock, err := s.DB.Begin()
	require.NoError(t, err)
	defer func() { _ = lock.Rollback() }()
	_, err = lock.Exec(`SELECT 1 FROM messaging_outbox WHERE message_id = 'a' FOR UPDATE`)
	require.NoError(t, err)
	var holder int
	require.NoError(t, lock.QueryRow(`SELECT pg_backend_pid()`).Scan(&holder))

	close(g.open)
	for _, id := range []string{"b", "c", "d"} {
		require.Equal(t, id, waitOrFail(t, g.entered, "publish of "+id), "batch 2 is published while batch 1's outcome statement waits")
	}
	await.Until(t, func() bool {
		return testdb.QueryInt(t, s.DB, `SELECT count(*) FROM pg_stat_activity
			WHERE $1::int = ANY(pg_blocking_pids(pid))`, holder) == 1
	}, "batch 1's outcome statement waits for the lock")
	for _, id := range []string{"a", "b", "c", "d"} {
		require.Equal(t, "IN_FLIGHT", state(t, s.DB, id).Status, "%s: no outcome is written before batch 1's", id)
	}
	mu.Lock()
	require.Empty(t, reports, "a pass reports once its outcomes are written")
	mu.Unlock()

	closed := make(chan error, 1)
	go func() { closed <- f.Close() }()
	select {
	case err := <-done:
		t.Fatalf("Run returned (%v) while an outcome statement was still waiting", err)
	default:
	}
	require.NoError(t, lock.Rollback())
	require.NoError(t, waitOrFail(t, closed, "Close"))
	require.NoError(t, waitOrFail(t, done, "Run"))
	for _, id := range []string{"a", "b", "c", "d"} {
		require.Equal(t, "PUBLISHED", state(t, s.DB, id).Status, id)
	}
	mu.Lock()
	defer mu.Unlock()
	require.GreaterOrEqual(t, len(reports), 2)
	for i := range 2 {
		require.Equal(t, forwarder.Report{Claimed: 2, Published: 2}, withoutDuration(reports[i]), "pass %d", i+1)
	}
}

// With prefetch a relay holds at most three batches' rows (the package
// documentation and Config.DisablePrefetch say so): the batch being
// published, the one claimed ahead, and the one before still having its
// outcomes written. Every publish counts the rows IN_FLIGHT under the relay
// at that moment.
func TestPrefetchHoldsAtMostThreeBatches(t *testing.T) {
	s := newDB(t)
	const batch = 3
	ids := make([]string, 20*batch)
	for i := range ids {
		ids[i] = fmt.Sprintf("m-%03d", i)
	}
	insertN(t, s.DB, "orders", ids...)
	var mu sync.Mutex
	most := 0
	rec := &recorder{behave: func(string, *message.Message) (bool, error) {
		var n int
		require.NoError(t, s.DB.QueryRow(`SELECT count(*) FROM messaging_outbox WHERE status = 'IN_FLIGHT' AND lease_owner = 'pf3'`).Scan(&n))
		mu.Lock()
		most = max(most, n)
		mu.Unlock()
		return true, nil
	}}
	f := newForwarder(t, s.DB, rec, forwarder.Config{Owner: "pf3", BatchSize: batch, Concurrency: 1})
	runUntilDelivered(t, f, rec, len(ids))
	mu.Lock()
	defer mu.Unlock()
	require.LessOrEqual(t, most, 3*batch)
	require.Greater(t, most, 0, "every publish saw its own row IN_FLIGHT")
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
	await.Until(t, func() bool { return state(t, s.DB, "m2").Status == "IN_FLIGHT" }, "m2 is claimed (IN_FLIGHT)")
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
	await.Until(t, func() bool { return state(t, s.DB, "m2").Status == "IN_FLIGHT" }, "m2 is claimed (IN_FLIGHT)")

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
