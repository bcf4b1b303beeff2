package cdcrelay_test

import (
	"context"
	"database/sql"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/cdcrelay"
	"github.com/fencedoutbox/watermill-outbox/debezium"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/await"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/publisher"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
)

// tally is a downstream without an inbox: it counts every delivery of every
// id, and which relay made it.
type tally struct {
	mu    sync.Mutex
	n     map[string]int
	who   map[string][]string // id -> relays that delivered it
	by    map[string]int      // relay -> deliveries
	total int
}

func newTally() *tally {
	return &tally{n: map[string]int{}, who: map[string][]string{}, by: map[string]int{}}
}

// as is the publisher one relay uses: the same tally, attributed to relay.
func (t *tally) as(relay string) message.Publisher { return tallyPub{t, relay} }

type tallyPub struct {
	t     *tally
	relay string
}

func (p tallyPub) Publish(_ string, msgs ...*message.Message) error {
	p.t.mu.Lock()
	defer p.t.mu.Unlock()
	for _, m := range msgs {
		p.t.n[m.UUID]++
		p.t.who[m.UUID] = append(p.t.who[m.UUID], p.relay)
		p.t.by[p.relay]++
		p.t.total++
	}
	return nil
}

func (tallyPub) Close() error { return nil }

func (t *tally) deliveries(relay string) int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.by[relay]
}

func (t *tally) has(ids []string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, id := range ids {
		if t.n[id] == 0 {
			return false
		}
	}
	return true
}

// writer commits one message per transaction until stopped, through the
// real write path, and remembers every id it committed.
type writer struct {
	stop    chan struct{}
	done    chan struct{}
	mu      sync.Mutex
	ids     []string
	written atomic.Int64
}

func startWriter(t *testing.T, db *sql.DB) *writer {
	t.Helper()
	w := &writer{stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(w.done)
		tick := time.NewTicker(3 * time.Millisecond) // pacing, not waiting: keeps the row count bounded
		defer tick.Stop()
		for i := 0; ; i++ {
			select {
			case <-w.stop:
				return
			case <-tick.C:
			}
			id := fmt.Sprintf("w-%06d", i)
			err := publisher.InTx(context.Background(), db, publisher.Config{Producer: "orders"}, func(_ context.Context, _ *sql.Tx, pub *publisher.Publisher) error {
				return pub.Publish("orders", message.NewMessage(id, []byte(id)))
			})
			if err != nil {
				t.Errorf("writer: %v", err)
				return
			}
			w.mu.Lock()
			w.ids = append(w.ids, id)
			w.mu.Unlock()
			w.written.Add(1)
		}
	}()
	t.Cleanup(w.halt)
	return w
}

func (w *writer) halt() {
	select {
	case <-w.stop:
	default:
		close(w.stop)
	}
	<-w.done
}

func (w *writer) all() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]string(nil), w.ids...)
}

// waitWritten waits until the writer has committed more rows than it had at
// the call, plus n: the phase that follows runs under writes.
func (w *writer) waitWritten(t *testing.T, n int64) {
	t.Helper()
	target := w.written.Load() + n
	require.Eventually(t, func() bool { return w.written.Load() >= target }, await.Patience(t), 5*time.Millisecond)
}

func startForwarder(t *testing.T, db *sql.DB, out message.Publisher, owner string) (stop func()) {
	t.Helper()
	fw, err := forwarder.New(db, out, nil, forwarder.Config{Owner: owner, PollInterval: 10 * time.Millisecond, MaxPollInterval: 50 * time.Millisecond})
	require.NoError(t, err)
	errc := make(chan error, 1)
	go func() { errc <- fw.Run(context.Background()) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			require.NoError(t, fw.Close())
			require.NoError(t, <-errc)
		})
	}
	t.Cleanup(stop)
	return stop
}

// TestHandoverRoundTrip is issue 20's handover: POLLING -> CDC -> POLLING
// under continuous writes, no faults, delivers every committed row exactly
// once. On the old code the CDC relay re-published every row the forwarders
// had published since the slot was created, and the forwarders re-published
// every row the CDC relay had delivered (200 of 200 in the issue).
func TestHandoverRoundTrip(t *testing.T) {
	base := testdb.Logical(t)
	e := newEnv(t, base)
	ctx := context.Background()
	sink := newTally()
	w := startWriter(t, e.s.DB)

	// POLLING.
	stopFw1 := startForwarder(t, e.s.DB, sink.as("polling-1"), "fw-1")
	w.waitWritten(t, 100)

	// Switch to CDC: the slot is prepared while the forwarders run, so every
	// row committed from then on is in it; the rows committed before it are
	// the forwarders' to deliver, and they do while writes go on.
	cfg := e.config()
	relay, err := cdcrelay.New(cfg, sink.as("cdc"), nil)
	require.NoError(t, err)
	require.NoError(t, relay.Prepare(ctx))
	require.Eventually(t, func() bool {
		n, known, err := cdcrelay.UndeliveredBeforeSlot(ctx, e.s.DB, cfg.SlotName)
		require.NoError(t, err)
		require.True(t, known)
		return n == 0
	}, await.Patience(t), 10*time.Millisecond, "the forwarders deliver the rows older than the slot")
	w.waitWritten(t, 50) // rows in the slot that the forwarders publish: the relay must skip them
	stopFw1()
	require.NoError(t, relaymode.Enable(ctx, e.s.DB, "test", time.Time{}))
	waitRelay := e.streaming(t, relay)
	w.waitWritten(t, 200)
	require.Eventually(t, func() bool { return sink.deliveries("cdc") >= 100 }, await.Patience(t), 10*time.Millisecond)

	// And back: the relay stops (marking what it delivered), then Disable.
	require.NoError(t, waitRelay())
	require.NoError(t, relaymode.Disable(ctx, e.s.DB, "test"))
	startForwarder(t, e.s.DB, sink.as("polling-2"), "fw-2")
	w.waitWritten(t, 100)
	w.halt()

	ids := w.all()
	require.Eventually(t, func() bool { return sink.has(ids) }, await.Patience(t), 10*time.Millisecond, "every committed row is delivered")
	sink.mu.Lock()
	defer sink.mu.Unlock()
	var twice []string
	for _, id := range ids {
		if sink.n[id] != 1 {
			var st, owner string
			var att int
			_ = e.s.DB.QueryRow(`SELECT status, coalesce(lease_owner, ''), attempts FROM messaging_outbox WHERE message_id = $1`, id).Scan(&st, &owner, &att)
			twice = append(twice, fmt.Sprintf("%s by %v (now %s, lease_owner %q, attempts %d)", id, sink.who[id], st, owner, att))
		}
	}
	require.Empty(t, twice, "no row delivered twice (%d rows, deliveries by relay: %v)", len(ids), sink.by)
	require.Equal(t, len(ids), sink.total, "nothing but the written rows")
	require.Positive(t, sink.by["polling-1"])
	require.Positive(t, sink.by["cdc"])
	require.Positive(t, sink.by["polling-2"])
	t.Logf("%d rows; deliveries by relay: %v", len(ids), sink.by)
}

// TestHandOverToPollingAfterAConsumerThatDoesNotMark: a Debezium connector
// marks nothing PUBLISHED, so Disable alone would let the forwarders publish
// again every row it delivered. HandOverToPolling, run after the connector
// stopped and under continuous writes, delivers what the connector left
// unconfirmed in the slot, marks what it had delivered, and switches: every
// row once. The connector is the native relay with its marks undone
// afterwards (the state a connector leaves: delivered, confirmed, PENDING).
func TestHandOverToPollingAfterAConsumerThatDoesNotMark(t *testing.T) {
	base := testdb.Logical(t)
	e := newEnv(t, base)
	ctx := context.Background()
	sink := newTally()
	w := startWriter(t, e.s.DB)

	stopFw1 := startForwarder(t, e.s.DB, sink.as("polling-1"), "fw-1")
	cfg := e.config()
	connector, err := cdcrelay.New(cfg, sink.as("connector"), nil)
	require.NoError(t, err)
	require.NoError(t, connector.Prepare(ctx))
	require.Eventually(t, func() bool {
		n, _, err := cdcrelay.UndeliveredBeforeSlot(ctx, e.s.DB, cfg.SlotName)
		require.NoError(t, err)
		return n == 0
	}, await.Patience(t), 10*time.Millisecond)
	stopFw1()
	require.NoError(t, relaymode.Enable(ctx, e.s.DB, "test", time.Time{}))
	waitConnector := e.streaming(t, connector)
	w.waitWritten(t, 150)
	require.Eventually(t, func() bool { return sink.deliveries("connector") >= 100 }, await.Patience(t), 10*time.Millisecond)
	require.NoError(t, waitConnector())
	res, err := e.s.DB.Exec(`UPDATE messaging_outbox SET status = 'PENDING', published_at = NULL, attempts = 0, lease_owner = NULL WHERE lease_owner = $1`, "cdc:"+cfg.SlotName)
	require.NoError(t, err)
	unmarked, _ := res.RowsAffected()
	require.Positive(t, unmarked)
	w.waitWritten(t, 50) // rows in the slot the connector never saw

	handover, err := cdcrelay.New(cfg, sink.as("handover"), nil)
	require.NoError(t, err)
	// While the connector's heartbeat is live the handover is refused.
	q, err := debezium.HeartbeatActionQuery(debezium.Options{Schema: e.s.Name, SlotName: cfg.SlotName})
	require.NoError(t, err)
	_, err = e.s.DB.Exec(q)
	require.NoError(t, err)
	err = handover.HandOverToPolling(ctx, "ops")
	require.ErrorIs(t, err, relaymode.ErrRelayModeConflict)
	require.Contains(t, err.Error(), "debezium:messaging-outbox")
	require.NoError(t, relaymode.Leave(ctx, e.s.DB, debezium.HeartbeatOwner("messaging-outbox"))) // the connector stopped and its heartbeat expired
	require.NoError(t, handover.HandOverToPolling(ctx, "ops"))
	mode, err := relaymode.CurrentMode(ctx, e.s.DB)
	require.NoError(t, err)
	require.Equal(t, relaymode.ModePolling, mode)

	startForwarder(t, e.s.DB, sink.as("polling-2"), "fw-2")
	w.waitWritten(t, 100)
	w.halt()
	ids := w.all()
	require.Eventually(t, func() bool { return sink.has(ids) }, await.Patience(t), 10*time.Millisecond, "every committed row is delivered")
	sink.mu.Lock()
	defer sink.mu.Unlock()
	var twice []string
	for _, id := range ids {
		if sink.n[id] != 1 {
			twice = append(twice, fmt.Sprintf("%s by %v", id, sink.who[id]))
		}
	}
	require.Empty(t, twice, "no row delivered twice (%d rows, deliveries by relay: %v)", len(ids), sink.by)
	require.Positive(t, sink.by["handover"], "the handover delivered what the connector left in the slot")
	require.Positive(t, sink.by["polling-2"])
	t.Logf("%d rows (%d unmarked); deliveries by relay: %v", len(ids), unmarked, sink.by)
}
