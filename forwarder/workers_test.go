package forwarder_test

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/forwarder"
)

// latent is a downstream whose every publish waits latency, as a broker
// across a network does, and records how many publishes were in flight at
// once after the first `after` publishes.
type latent struct {
	latency time.Duration
	after   int
	mu      sync.Mutex
	started int
	now     int
	peak    int
	rec     recorder
}

func (l *latent) Publish(topic string, msgs ...*message.Message) error {
	l.mu.Lock()
	l.started++
	l.now++
	if l.started > l.after {
		l.peak = max(l.peak, l.now)
	}
	l.mu.Unlock()
	time.Sleep(l.latency) // the network round trip being modelled, not a wait for an event
	l.mu.Lock()
	l.now--
	l.mu.Unlock()
	return l.rec.Publish(topic, msgs...)
}

func (l *latent) Close() error { return nil }

// Publishes that wait on the network go out Concurrency at a time, in
// every pass, also once they are timed (the timing sizes batches and chains,
// not the number of publishes at once).
func TestPublishesThatWaitGoOutConcurrencyAtATime(t *testing.T) {
	s := newDB(t)
	const batch, passes = 8, 6
	ids := make([]string, batch*passes)
	for i := range ids {
		ids[i] = fmt.Sprintf("m-%02d", i)
	}
	insertN(t, s.DB, "orders", ids...)
	out := &latent{latency: 20 * time.Millisecond, after: batch}
	f := newForwarder(t, s.DB, out, forwarder.Config{Owner: "relay-a", BatchSize: batch, MaxBatchSize: batch, Concurrency: 4})
	runUntilDelivered(t, f, &out.rec, len(ids))
	out.mu.Lock()
	defer out.mu.Unlock()
	require.Equal(t, 4, out.peak, "the passes after the first, with their publishes timed")
}
