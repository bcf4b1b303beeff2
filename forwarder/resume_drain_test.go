package forwarder_test

// Hostile review 2 (inline publish, resumed keys, the claim's lock step).

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/fencedoutbox/watermill-outbox/forwarder"
)

// a relay whose outcome write failed still resumes the key behind
// the row it published but could not record. That row stays IN_FLIGHT under
// this relay; once its lease expires it is claimable again, and the resumed
// continuation (whose EXISTS accepts "IN_FLIGHT under my owner" without
// looking at the lease) claims and publishes the key's next row past it.
// Downstream sees k1, k2, then k1 again (a stale k1 after k2), where the
// walk used before resumed keys (and a fresh relay) delivers k1, k1, k2.
func TestResumedKeySkipsRowWhoseOutcomeWriteFailed(t *testing.T) {
	s := newDB(t)
	insertKeyed(t, s.DB, "k1", "K")
	insertKeyed(t, s.DB, "k2", "K")
	rec := &recorder{}
	clk := newClock()
	f := newForwarder(t, s.DB, rec, forwarder.Config{Now: clk.Now, BatchSize: 1,
		LeaseDuration: time.Minute, PublishTimeout: 10 * time.Second})
	d := withFaults(t, f)
	d.failOutcomes.Store(3) // every try of the first outcome write
	ctx := context.Background()

	rep, err := f.RunOnce(ctx)
	require.Error(t, err, "the outcome write failed")
	require.Equal(t, 1, rep.UnrecordedPublishes)
	require.Equal(t, []string{"k1"}, rec.ids())
	require.Equal(t, "IN_FLIGHT", state(t, s.DB, "k1").Status)

	clk.Advance(2 * time.Minute) // k1's lease expires: k1 is claimable again
	_, err = f.RunOnce(ctx)
	require.NoError(t, err)
	got := rec.ids()
	if len(got) >= 2 && got[1] == "k2" {
		t.Errorf("k2 went out while k1, earlier in K, was claimable (its lease expired, never recorded PUBLISHED): deliveries %v, k1 now %+v",
			got, state(t, s.DB, "k1"))
	}
	// Whatever the second pass did, the next passes deliver the rest.
	for i := 0; i < 4 && s.Count(t, "status <> 'PUBLISHED'") > 0; i++ {
		_, err = f.RunOnce(ctx)
		require.NoError(t, err)
	}
	got = rec.ids()
	for i := 1; i < len(got); i++ {
		if got[i-1] == "k2" && got[i] == "k1" {
			t.Errorf("key K delivered k1 after k2: %v", got)
		}
	}
}

// hookTracer lets a test stop a publish between its first drain check and
// the registration of its call (tracer.Start runs there), and see spans end.
type hookProvider struct {
	noop.TracerProvider
	tr *hookTracer
}

func (p hookProvider) Tracer(string, ...trace.TracerOption) trace.Tracer { return p.tr }

type hookTracer struct {
	noop.Tracer
	start func(name string)
	end   func(name string)
}

func (h *hookTracer) Start(ctx context.Context, name string, _ ...trace.SpanStartOption) (context.Context, trace.Span) {
	h.start(name)
	sp := &hookSpan{name: name, end: h.end}
	return trace.ContextWithSpan(ctx, sp), sp
}

type hookSpan struct {
	noop.Span
	name string
	end  func(string)
}

func (s *hookSpan) End(...trace.SpanEndOption) { s.end(s.name) }

// topicPublisher hangs on topic "b" (ignoring its context) until release,
// and records every other publish.
type topicPublisher struct {
	mu        sync.Mutex
	delivered []string
	bEntered  chan struct{}
	release   chan struct{}
}

func (p *topicPublisher) Publish(topic string, msgs ...*message.Message) error {
	if topic == "b" {
		close(p.bEntered)
		<-p.release
		return nil
	}
	p.mu.Lock()
	p.delivered = append(p.delivered, msgs[0].UUID)
	p.mu.Unlock()
	return nil
}

func (p *topicPublisher) Close() error { return nil }

func (p *topicPublisher) ids() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.delivered...)
}

// when the drain deadline passes after a worker's first drain check
// but before its call is registered, publish calls c.expire() (the row is
// settled AMBIGUOUS "still running when the drain deadline passed" and a new
// goroutine carries the worker on) and then calls the downstream publisher
// anyway: a publish that starts after the drain deadline, after RunOnce (or
// Close) returned, on a publisher the application is now free to close.
func TestNoPublishStartsAfterTheDrainDeadline(t *testing.T) {
	s := newDB(t)
	insert(t, s.DB, "a", message.NewMessage("ma", []byte("x")))
	insert(t, s.DB, "b", message.NewMessage("mb", []byte("x")))
	out := &topicPublisher{bEntered: make(chan struct{}), release: make(chan struct{})}
	t.Cleanup(func() { close(out.release) })
	aAtStart, bEnded := make(chan struct{}), make(chan struct{})
	var once sync.Once
	tr := &hookTracer{
		start: func(name string) {
			if name == "outbox.publish a" {
				close(aAtStart)
				<-bEnded // held here until the drain deadline left "b" behind
			}
		},
		end: func(name string) {
			if name == "outbox.publish b" {
				once.Do(func() { close(bEnded) })
			}
		},
	}
	f := newForwarder(t, s.DB, out, forwarder.Config{
		Concurrency: 2, PublishTimeout: 5 * time.Second, DrainTimeout: 50 * time.Millisecond,
		TracerProvider: hookProvider{tr: tr},
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
	waitOrFail(t, out.bEntered, "the publish of mb")
	waitOrFail(t, aAtStart, "the publish of ma reaching tracer.Start")
	cancel() // stopping, then the drain deadline 50 ms later
	res := waitOrFail(t, done, "RunOnce returning after the drain deadline")
	require.NoError(t, res.err)
	require.Equal(t, "AMBIGUOUS", state(t, s.DB, "ma").Status, "ma was left behind by the drain deadline")
	// The failing case is an event (the publisher is called right after
	// expire, on the same goroutine); a correct relay never calls it, so
	// this can only be checked over a bounded window.
	require.Never(t, func() bool { return len(out.ids()) > 0 }, 300*time.Millisecond, 5*time.Millisecond,
		"ma was handed to the publisher after the drain deadline had left it behind (RunOnce already returned)")
}

// ctxPublisher blocks until the message's context ends (a well-behaved
// downstream) or release, and hands the context to the test.
type ctxPublisher struct {
	ctxs    chan context.Context
	release chan struct{}
}

func (p *ctxPublisher) Publish(_ string, msgs ...*message.Message) error {
	ctx := msgs[0].Context()
	p.ctxs <- ctx
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-p.release:
		return nil
	}
}

func (p *ctxPublisher) Close() error { return nil }

// the drain deadline leaves a running publish behind (its row is
// recorded AMBIGUOUS and RunOnce/Close return) but never cancels the
// publish's context: a downstream that honours its context keeps sending
// for the rest of PublishTimeout after Close returned, when the application
// closes that publisher. expire should cancel the call's context.
func TestDrainDeadlineCancelsTheLeftBehindPublish(t *testing.T) {
	s := newDB(t)
	insertN(t, s.DB, "orders", "m1")
	out := &ctxPublisher{ctxs: make(chan context.Context, 1), release: make(chan struct{})}
	t.Cleanup(func() { close(out.release) })
	f := newForwarder(t, s.DB, out, forwarder.Config{
		Concurrency: 1, PublishTimeout: 10 * time.Second, DrainTimeout: 50 * time.Millisecond,
	})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() {
		_, err := f.RunOnce(ctx)
		done <- err
	}()
	pctx := waitOrFail(t, out.ctxs, "the publish of m1")
	cancel()
	require.NoError(t, waitOrFail(t, done, "RunOnce returning after the drain deadline"))
	require.Equal(t, "AMBIGUOUS", state(t, s.DB, "m1").Status)
	require.Error(t, pctx.Err(), "RunOnce returned (the drain deadline left m1 behind) but m1's publish context is still live: the downstream keeps sending after the relay stopped")
}

// (the README's first wording, "waits at most 8 claims", was false
// once more keys have work than one batch takes): the full walk every 8th
// claim starts where the last walk stopped and stops when the batch is
// full, like every walk, so it reaches the late row's key within one
// rotation over the keys with work, and meanwhile later rows of that key go
// out ahead of it, as with any late commit. The late row is not lost, and
// its wait is bounded by 8 claims per key with work (here 41 keys, BatchSize
// 2: measured about 50 claims).
func TestLateRowBelowResumedKeyIsFoundByTheRotatingFullWalk(t *testing.T) {
	s := newDB(t)
	for i := 1; i <= 60; i++ {
		insertKeyed(t, s.DB, fmt.Sprintf("k%02d", i), "K")
	}
	for i := 0; i < 40; i++ {
		insertKeyed(t, s.DB, fmt.Sprintf("l%02d", i), fmt.Sprintf("L%02d", i))
	}
	rec := &recorder{}
	f := newForwarder(t, s.DB, rec, forwarder.Config{Now: newClock().Now, BatchSize: 2, Concurrency: 2})
	ctx := context.Background()
	_, err := f.RunOnce(ctx)
	require.NoError(t, err)
	require.Contains(t, rec.ids(), "k01")

	_, err = s.DB.Exec(`INSERT INTO messaging_outbox (seq, message_id, destination, payload, ordering_key)
		OVERRIDING SYSTEM VALUE VALUES (0, 'late', 'orders', 'x', 'K')`)
	require.NoError(t, err)
	before := len(rec.ids())
	passes := 0
	for !slices.Contains(rec.ids(), "late") && passes < 400 {
		passes++
		_, err := f.RunOnce(ctx)
		require.NoError(t, err)
	}
	var overtook []string
	for _, id := range rec.ids()[before:] {
		if id == "late" {
			break
		}
		if strings.HasPrefix(id, "k") {
			overtook = append(overtook, id)
		}
	}
	require.Contains(t, rec.ids(), "late", "the late row of K is found")
	require.LessOrEqual(t, passes, 8*41, "the late row of K waited %d claims; %d later rows of K went out ahead of it meanwhile: %v",
		passes, len(overtook), overtook)
}

// MaxAbandoned ("a downstream that hangs on everything costs at
// most this many goroutines") is only checked before a claim. Within one
// pass every publish that times out is left behind and the worker goes on
// to the next unit, which hangs too: one batch of rows for distinct
// destinations (so no breaker opens) leaves the whole batch behind.
func TestOnePassLeavesAtMostMaxAbandonedBehind(t *testing.T) {
	s := newDB(t)
	for i := range 12 {
		insert(t, s.DB, fmt.Sprintf("dest%02d", i), message.NewMessage(fmt.Sprintf("m%02d", i), []byte("x")))
	}
	h := &hangCounter{release: make(chan struct{})}
	t.Cleanup(func() { close(h.release) })
	const maxAbandoned = 2
	f := newForwarder(t, s.DB, h, forwarder.Config{
		BatchSize: 12, Concurrency: 1, MaxAbandoned: maxAbandoned, Now: newClock().Now,
		PublishTimeout: 20 * time.Millisecond, LeaseDuration: time.Second, DrainTimeout: 20 * time.Millisecond,
	})
	rep, err := f.RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, 12, rep.Claimed)
	require.LessOrEqual(t, int(h.hanging.Load()), maxAbandoned+1,
		"one pass left %d publishes running in a downstream that ignores its context (MaxAbandoned %d); report %+v",
		h.hanging.Load(), maxAbandoned, withoutDuration(rep))
}

// (guard; passes on the PostgreSQL the suite runs): the claim's
// lock step no longer repeats the claimable test and relies on the TID scan
// refusing, under EvalPlanQual, a row version other than the ctid the walk
// judged. PostgreSQL's TidRecheck long returned true unconditionally (see
// nodeTidscan.c "XXX shouldn't we check here to make sure tuple matches TID
// list?"); on a server that still does, the lock step locks the version
// another relay just committed (IN_FLIGHT under it), the rank check counts
// it, and the rows behind it are claimed while the key's head is with the
// other relay. This test fails on such a server.
func TestLockByCtidRefusesANewerVersion(t *testing.T) {
	s := newDB(t)
	insertKeyed(t, s.DB, "k1", "K")
	ctx := context.Background()
	var ctid string
	require.NoError(t, s.DB.QueryRow(`SELECT ctid::text FROM messaging_outbox WHERE message_id = 'k1'`).Scan(&ctid))

	other, err := s.DB.BeginTx(ctx, nil) // "another relay" claims k1
	require.NoError(t, err)
	defer func() { _ = other.Rollback() }()
	_, err = other.Exec(`UPDATE messaging_outbox SET status = 'IN_FLIGHT', lease_owner = 'other',
		lease_token = lease_token + 1, lease_expires_at = now() + interval '1 minute' WHERE message_id = 'k1'`)
	require.NoError(t, err)

	type res struct {
		ids []string
		err error
	}
	got := make(chan res, 1)
	go func() {
		rows, err := s.DB.QueryContext(ctx, `SELECT o.message_id FROM messaging_outbox o
			WHERE o.ctid = ANY (ARRAY[$1::tid]) FOR UPDATE OF o`, ctid)
		if err != nil {
			got <- res{err: err}
			return
		}
		defer rows.Close()
		var ids []string
		for rows.Next() {
			var id string
			if err := rows.Scan(&id); err != nil {
				got <- res{err: err}
				return
			}
			ids = append(ids, id)
		}
		got <- res{ids, rows.Err()}
	}()
	require.Eventually(t, func() bool { // the lock waits on "other"
		var n int
		require.NoError(t, s.DB.QueryRow(`SELECT count(*) FROM pg_stat_activity
			WHERE wait_event_type = 'Lock' AND query LIKE '%o.ctid = ANY (ARRAY[$1::tid])%'`).Scan(&n))
		return n == 1
	}, 10*time.Second, 5*time.Millisecond)
	require.NoError(t, other.Commit())
	r := waitOrFail(t, got, "the lock by ctid")
	require.NoError(t, r.err)
	require.Empty(t, r.ids, "the lock by ctid took the newer version of k1 (TidRecheck does not check the TID list on this server)")
}

// the claim "that walks every key" every walkEvery-th time does
// not walk when the last walk found no keyed rows: Forwarder.claim sets
// walk := full, then, since a full walk resumes nothing (resume is empty),
// overwrites it with walkDue(), which says no until walkEvery calls of its
// own. A single hot key K resumed on every claim beside unkeyed traffic
// that fills the batches: the every-8th claim claims unkeyed rows only, and
// a late row of K waits ~walkEvery x walkEvery claims while K's later rows
// overtake it.
func TestFullWalkClaimWalksEvenAfterAWalkFoundNoKeys(t *testing.T) {
	s := newDB(t)
	insertKeyed(t, s.DB, "k01", "K")
	rec := &recorder{}
	f := newForwarder(t, s.DB, rec, forwarder.Config{Now: newClock().Now, BatchSize: 2, Concurrency: 2})
	ctx := context.Background()
	_, err := f.RunOnce(ctx) // walks: k01
	require.NoError(t, err)
	insertKeyed(t, s.DB, "k02", "K")
	_, err = f.RunOnce(ctx) // resumes K: k02; short, so the keys are walked for the rest and none is found
	require.NoError(t, err)
	require.Equal(t, []string{"k01", "k02"}, rec.ids())

	_, err = s.DB.Exec(`INSERT INTO messaging_outbox (seq, message_id, destination, payload, ordering_key)
		OVERRIDING SYSTEM VALUE VALUES (0, 'late', 'orders', 'x', 'K')`)
	require.NoError(t, err)
	for i := 3; i <= 80; i++ { // K and unkeyed rows interleaved: every batch is one of each, full
		insertKeyed(t, s.DB, fmt.Sprintf("k%02d", i), "K")
		insertKeyed(t, s.DB, fmt.Sprintf("u%02d", i), "")
	}
	before := len(rec.ids())
	passes := 0
	for !slices.Contains(rec.ids(), "late") && passes < 400 {
		passes++
		_, err := f.RunOnce(ctx)
		require.NoError(t, err)
	}
	var overtook []string
	for _, id := range rec.ids()[before:] {
		if id == "late" {
			break
		}
		if strings.HasPrefix(id, "k") {
			overtook = append(overtook, id)
		}
	}
	require.LessOrEqual(t, passes, 8, "the late row of K waited %d claims (README: at most 8); %d later rows of K went out ahead of it: %v",
		passes, len(overtook), overtook)
}

// closingPublisher calls Close on the forwarder from inside Publish (a
// downstream that shuts the relay down on a fatal error).
type closingPublisher struct {
	f        *forwarder.Forwarder
	closeErr chan error
	once     sync.Once
}

func (p *closingPublisher) Publish(string, ...*message.Message) error {
	p.once.Do(func() { p.closeErr <- p.f.Close() })
	return nil
}

func (p *closingPublisher) Close() error { return nil }

// (held): a publisher that calls Forwarder.Close from inside
// Publish does not deadlock the inline publish: the drain deadline leaves
// the call behind, the pass ends, Run returns and so does Close.
func TestPublisherClosingTheRelayFromPublish(t *testing.T) {
	s := newDB(t)
	insertN(t, s.DB, "orders", "m1", "m2")
	out := &closingPublisher{closeErr: make(chan error, 1)}
	f := newForwarder(t, s.DB, out, forwarder.Config{Concurrency: 1, DrainTimeout: 50 * time.Millisecond})
	out.f = f
	runErr := make(chan error, 1)
	go func() { runErr <- f.Run(context.Background()) }()
	require.NoError(t, waitOrFail(t, runErr, "Run returning"))
	require.NoError(t, waitOrFail(t, out.closeErr, "Close returning inside Publish"))
	require.Zero(t, s.Count(t, "status = 'IN_FLIGHT'"))
	require.Equal(t, "AMBIGUOUS", state(t, s.DB, "m1").Status, "m1's publish outlived the drain deadline")
	require.Equal(t, "PENDING", state(t, s.DB, "m2").Status)
}
