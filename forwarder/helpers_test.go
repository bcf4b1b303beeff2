package forwarder_test

import (
	"context"
	"database/sql"
	"errors"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/leakcheck"
	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/await"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

func TestMain(m *testing.M) {
	if url := os.Getenv(laneChildEnv); url != "" {
		runLaneChild(url) // a relay process of TestAMessageThatKillsItsRelayEndsExhausted
	}
	leakcheck.VerifyTestMain(m,
		// database/sql's opener goroutine of pools closed in t.Cleanup after
		// the last test may still be unwinding.
		leakcheck.IgnoreTopFunction("database/sql.(*DB).connectionOpener"),
		// OpenCensus (pulled in by the cloud SDKs in the module) starts a
		// worker at init.
		leakcheck.IgnoreTopFunction("go.opencensus.io/stats/view.(*worker).start"),
	)
}

var t0 = time.Date(2030, 1, 1, 12, 0, 0, 0, time.UTC)

// clock is an injectable clock; it moves only when the test moves it, or by
// step on every reading when step is set.
type clock struct {
	mu   sync.Mutex
	now  time.Time
	step time.Duration
}

func newClock() *clock { return &clock{now: t0} }

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(c.step)
	return c.now
}

func (c *clock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

func newDB(t *testing.T) *testdb.Schema {
	t.Helper()
	s := testdb.New(t)
	s.DB.SetMaxOpenConns(6)
	return s
}

// startRun starts f.Run(ctx) and returns the channel its result comes on.
func startRun(ctx context.Context, f *forwarder.Forwarder) chan error {
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	return done
}

type execer = testdb.Execer

// insert writes msg for topic the way the transactional publisher does:
// through envelope.ToRow.
func insert(t *testing.T, db execer, topic string, msg *message.Message) {
	t.Helper()
	r, err := envelope.ToRow(topic, msg, envelope.Options{})
	require.NoError(t, err)
	testdb.InsertRow(t, db, r)
}

func insertN(t *testing.T, db execer, topic string, ids ...string) {
	t.Helper()
	for _, id := range ids {
		insert(t, db, topic, message.NewMessage(id, []byte("payload-"+id)))
	}
}

type rowState struct {
	Status, Code, Owner string
	Attempts            int
	Next, Parked        sql.NullTime
}

func state(t *testing.T, db *sql.DB, id string) rowState {
	t.Helper()
	var s rowState
	var code, owner sql.NullString
	require.NoError(t, db.QueryRow(`SELECT status, last_failure_code, lease_owner, attempts, next_attempt_at, parked_at
		FROM messaging_outbox WHERE message_id = $1`, id).Scan(&s.Status, &code, &owner, &s.Attempts, &s.Next, &s.Parked))
	s.Code, s.Owner = code.String, owner.String
	return s
}

// recorder is a downstream publisher whose behaviour per message is chosen
// by the test; it records every message it was handed (delivered), also
// those it then reports an error for.
type recorder struct {
	mu        sync.Mutex
	delivered []delivery
	behave    func(topic string, msg *message.Message) (deliver bool, err error)
	closed    atomic.Bool
}

type delivery struct {
	topic string
	msg   *message.Message
}

func (r *recorder) Publish(topic string, msgs ...*message.Message) error {
	for _, m := range msgs {
		deliver, err := true, error(nil)
		if r.behave != nil {
			deliver, err = r.behave(topic, m)
		}
		if deliver {
			r.mu.Lock()
			r.delivered = append(r.delivered, delivery{topic, m})
			r.mu.Unlock()
		}
		if err != nil {
			return err
		}
	}
	return nil
}

func (r *recorder) Close() error { r.closed.Store(true); return nil }

func (r *recorder) ids() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]string, 0, len(r.delivered))
	for _, d := range r.delivered {
		out = append(out, d.msg.UUID)
	}
	return out
}

// hanger blocks in Publish, ignoring the context, until release is closed.
type hanger struct {
	entered chan string
	release chan struct{}
}

func newHanger(t *testing.T) *hanger {
	h := &hanger{entered: make(chan string, 100), release: make(chan struct{})}
	t.Cleanup(func() { close(h.release) })
	return h
}

func (h *hanger) Publish(topic string, msgs ...*message.Message) error {
	h.entered <- msgs[0].UUID
	<-h.release
	return nil
}

func (h *hanger) Close() error { return nil }

type panicker struct{}

func (panicker) Publish(string, ...*message.Message) error { panic("broker client bug") }
func (panicker) Close() error                              { return nil }

var errBroker = errors.New("broker: connection reset after send")

func newForwarder(t *testing.T, db *sql.DB, out message.Publisher, cfg forwarder.Config) *forwarder.Forwarder {
	t.Helper()
	f, err := forwarder.New(db, out, nil, cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = f.Close() })
	return f
}

// runUntilDelivered runs f until rec has n deliveries, then closes it and
// requires a clean stop.
func runUntilDelivered(t *testing.T, f *forwarder.Forwarder, rec *recorder, n int) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- f.Run(context.Background()) }()
	await.Until(t, func() bool { return len(rec.ids()) == n }, "%d deliveries", n)
	require.NoError(t, f.Close())
	require.NoError(t, <-done)
}

// waitOrFail waits for ch, failing the test (instead of hanging it) when
// the thing it signals has not happened by the test's deadline
// (await.Patience).
func waitOrFail[T any](t *testing.T, ch <-chan T, what string) T {
	t.Helper()
	patience := await.Patience(t)
	select {
	case v := <-ch:
		return v
	case <-time.After(patience):
		t.Fatalf("%s did not happen within %s", what, patience.Round(time.Second))
		panic("unreachable")
	}
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
