package cdcrelay

import (
	"context"
	"database/sql"
	"math"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
)

func TestNextDelayDoesNotWrap(t *testing.T) {
	require.Equal(t, 200*time.Millisecond, nextDelay(100*time.Millisecond, 10*time.Second))
	require.Equal(t, 10*time.Second, nextDelay(6*time.Second, 10*time.Second))
	require.Equal(t, 10*time.Second, nextDelay(10*time.Second, 10*time.Second))
	// d*2 wraps to a negative delay here: the relay would retry in a hot loop.
	require.Equal(t, time.Duration(math.MaxInt64), nextDelay(1<<62, math.MaxInt64))
	require.Equal(t, time.Duration(math.MaxInt64), nextDelay(math.MaxInt64, math.MaxInt64))
}

func TestCloseBeforeRunAndTwice(t *testing.T) {
	r, err := New(Config{ConnString: "postgres://u@127.0.0.1/db", DB: &sql.DB{}}, nopPublisher{}, nil)
	require.NoError(t, err)
	require.NoError(t, r.Close())
	require.NoError(t, r.Close())
	require.ErrorIs(t, r.Run(t.Context()), ErrRelayClosed)
}

// holdPub blocks every Publish until release is closed; finished is set
// just before it returns.
type holdPub struct {
	entered  chan struct{}
	release  chan struct{}
	finished atomic.Bool
}

func (p *holdPub) Publish(string, ...*message.Message) error {
	p.entered <- struct{}{}
	<-p.release
	p.finished.Store(true)
	return nil
}

func (p *holdPub) Close() error { return nil }

// A publish still running DrainTimeout after the stop is left behind, and
// the next Run of the same Relay waits for it before anything else: it
// never has two publishes at once, and the message left behind is not
// overtaken by the messages after it.
func TestAPublishLeftBehindIsWaitedForByTheNextRun(t *testing.T) {
	s := testdb.New(t) // POLLING mode: a Run that goes on is refused at once
	p := &holdPub{entered: make(chan struct{}, 1), release: make(chan struct{})}
	var once sync.Once
	release := func() { once.Do(func() { close(p.release) }) }
	t.Cleanup(release)
	r, err := New(Config{ConnString: "postgres://u@127.0.0.1/db", DB: s.DB, Schema: s.Name, DrainTimeout: 10 * time.Millisecond}, p, nil)
	require.NoError(t, err)

	ctx, cancel := context.WithCancel(t.Context())
	publishErr := make(chan error, 1)
	returned := make(chan bool, 1)
	go func() {
		ok, err := r.publish(ctx, "orders", message.NewMessage("m1", nil))
		returned <- ok
		publishErr <- err
	}()
	<-p.entered
	cancel() // the stop: the publish gets DrainTimeout, then it is left behind
	require.False(t, <-returned, "left behind")
	require.NoError(t, <-publishErr)

	ran := make(chan error, 1)
	go func() { ran <- r.Run(t.Context()) }()
	release()
	err = <-ran
	require.ErrorIs(t, err, relaymode.ErrRelayModeConflict, "Run went on once the publish had returned")
	require.True(t, p.finished.Load(), "Run checked the relay mode only once the publish left behind had returned")
}

type panicPub struct{}

func (panicPub) Publish(string, ...*message.Message) error { panic("broker client bug") }
func (panicPub) Close() error                              { return nil }

// A publisher's panic reaches Run's goroutine, as when Run called it
// directly.
func TestAPublisherPanicIsRaisedOnRunsGoroutine(t *testing.T) {
	r, err := New(Config{ConnString: "postgres://u@127.0.0.1/db", DB: &sql.DB{}}, panicPub{}, nil)
	require.NoError(t, err)
	require.PanicsWithValue(t, "broker client bug", func() { _, _ = r.publish(t.Context(), "orders", message.NewMessage("m1", nil)) })
}
