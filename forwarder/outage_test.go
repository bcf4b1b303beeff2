package forwarder_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/await"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/status"
)

// outage is a downstream that fails every publish to the destinations in
// down with a plain error (what a broker client returns when the broker is
// gone; the default classifier cannot tell it from an ambiguous one) and
// records what it delivered.
type outage struct {
	mu        sync.Mutex
	down      map[string]bool
	failed    map[string]int // failed publish calls per message id
	delivered map[string]int
	calls     atomic.Int64
	failWith  func(topic string, m *message.Message) (deliver bool, err error)
}

func newOutage(down ...string) *outage {
	o := &outage{down: map[string]bool{}, failed: map[string]int{}, delivered: map[string]int{}}
	for _, d := range down {
		o.down[d] = true
	}
	return o
}

func (o *outage) set(dest string, down bool) {
	o.mu.Lock()
	o.down[dest] = down
	o.mu.Unlock()
}

func (o *outage) Publish(topic string, msgs ...*message.Message) error {
	o.calls.Add(1)
	o.mu.Lock()
	defer o.mu.Unlock()
	for _, m := range msgs {
		if o.failWith != nil {
			if deliver, err := o.failWith(topic, m); err != nil {
				if deliver {
					o.delivered[m.UUID]++
				}
				o.failed[m.UUID]++
				return err
			}
		}
		if o.down[topic] {
			o.failed[m.UUID]++
			return errors.New("dial tcp 10.0.0.7:5672: connect: connection refused")
		}
		o.delivered[m.UUID]++
	}
	return nil
}

func (o *outage) Close() error { return nil }

func (o *outage) counts() (delivered, failedCalls int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	for _, n := range o.failed {
		failedCalls += n
	}
	return len(o.delivered), failedCalls
}

func fill(t *testing.T, s *testdb.Schema, dest, prefix string, n int) {
	t.Helper()
	rows := make([]testdb.OutboxRow, 0, n)
	for g := 1; g <= n; g++ {
		rows = append(rows, testdb.Row(envelope.Row{MessageID: prefix + strconv.Itoa(g), Destination: dest, Payload: []byte{0}}))
	}
	testdb.InsertRows(t, s.DB, rows...)
}

// statusCounts returns how many rows are in each status.
func statusCounts(t *testing.T, s *testdb.Schema) map[string]int {
	t.Helper()
	rows, err := s.DB.Query(`SELECT status, count(*) FROM messaging_outbox GROUP BY status`)
	require.NoError(t, err)
	defer rows.Close()
	out := map[string]int{}
	for rows.Next() {
		var st string
		var n int
		require.NoError(t, rows.Scan(&st, &n))
		out[st] = n
	}
	require.NoError(t, rows.Err())
	return out
}

// outageConfig is the defaults scaled down: backoff and probes in tens of
// milliseconds, so an outage of a second outlasts the whole retry horizon
// (about 0.3 s at MaxAttempts 10).
func outageConfig() forwarder.Config {
	return forwarder.Config{
		BackoffBase: 10 * time.Millisecond, BackoffMax: 60 * time.Millisecond, MaxAttempts: 10,
		PollInterval: 5 * time.Millisecond, MaxPollInterval: 50 * time.Millisecond,
		BreakerProbeBase: 20 * time.Millisecond, BreakerProbeMax: 100 * time.Millisecond,
	}
}

type relaySet struct {
	fs   []*forwarder.Forwarder
	done []chan error
	mu   sync.Mutex
	reps []forwarder.Report
}

func startRelays(t *testing.T, db *testdb.Schema, out message.Publisher, n int, cfg forwarder.Config) *relaySet {
	t.Helper()
	rs := &relaySet{}
	cfg.OnReport = func(r forwarder.Report) { rs.mu.Lock(); rs.reps = append(rs.reps, r); rs.mu.Unlock() }
	for range n {
		f, err := forwarder.New(db.DB, out, nil, cfg)
		require.NoError(t, err)
		d := make(chan error, 1)
		go func() { d <- f.Run(context.Background()) }()
		rs.fs, rs.done = append(rs.fs, f), append(rs.done, d)
	}
	t.Cleanup(func() { rs.stop(t) })
	return rs
}

func (rs *relaySet) stop(t *testing.T) {
	for i, f := range rs.fs {
		if f == nil {
			continue
		}
		require.NoError(t, f.Close())
		require.NoError(t, <-rs.done[i])
		rs.fs[i] = nil
	}
}

func (rs *relaySet) sawOpen(dest string) bool {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	for _, r := range rs.reps {
		for _, b := range r.OpenBreakers {
			if b.Destination == dest {
				return true
			}
		}
	}
	return false
}

func (rs *relaySet) total(f func(forwarder.Report) int) int {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	n := 0
	for _, r := range rs.reps {
		n += f(r)
	}
	return n
}

// The outage experiment: 1,000 PENDING rows, a downstream that refuses every
// publish for longer than the whole retry horizon, then recovers. No row is
// parked, every row is delivered after the recovery, and the outage spent
// almost nothing: the breaker stopped the relays from trying the backlog, and
// a row's attempts are at most one more than the failed publishes it carried
// (probes). Also with 4 relays and NOTIFY, with rows committed during the
// outage.
func TestBrokerOutageSpendsNoBudget(t *testing.T) {
	t.Parallel() // waits on leases, outages and processes: overlaps the other parallel tests
	for _, c := range []struct {
		name            string
		relays          int
		notify          bool
		duringTheOutage int
	}{
		{"one relay", 1, false, 0},
		{"four relays, NOTIFY, rows committed during the outage", 4, true, 200},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := newDB(t)
			s.DB.SetMaxOpenConns(20)
			s.DB.SetMaxIdleConns(20) // idle as many as open: no reconnect per statement (testdb.IdleConns)
			fill(t, s, "orders", "m", 1000)
			down := newOutage("orders")
			cfg := outageConfig()
			if c.notify {
				cfg.ListenURL = s.URL
			}
			rs := startRelays(t, s, down, c.relays, cfg)

			// The outage lasts until the breaker has opened and the relays
			// have probed at least ten times, and at least a second (more
			// than three retry horizons).
			began := time.Now()
			await.Until(t, func() bool { return rs.sawOpen("orders") }, "the breaker opens")
			await.Until(t, func() bool {
				for _, f := range rs.fs {
					if errors.Is(f.Ready(), forwarder.ErrDownstreamUnavailable) {
						return true
					}
				}
				return false
			}, "a relay whose only destination is down is alive, not ready")
			probesBefore := down.calls.Load()
			if c.duringTheOutage > 0 {
				fill(t, s, "orders", "late", c.duringTheOutage)
			}
			await.Until(t, func() bool {
				return down.calls.Load() >= probesBefore+10 && time.Since(began) > time.Second
			}, "the relays keep probing")
			st := statusCounts(t, s)
			require.Zero(t, st["EXHAUSTED"]+st["FAILED"], "the outage parked rows: %v", st)
			down.set("orders", false)

			total := 1000 + c.duringTheOutage
			if !assertEventually(t, func() bool { return statusCounts(t, s)["PUBLISHED"] == total }, 30*time.Second) {
				rs.mu.Lock()
				last := rs.reps[len(rs.reps)-5:]
				rs.mu.Unlock()
				t.Fatalf("not every row was delivered after the recovery: %v; last reports %+v", statusCounts(t, s), last)
			}
			rs.stop(t)
			delivered, failedCalls := down.counts()
			require.Equal(t, total, delivered)
			st = statusCounts(t, s)
			require.Equal(t, map[string]int{"PUBLISHED": total}, st)
			// The breaker kept the relays off the backlog: far fewer failed
			// publishes than rows (without it every row is tried again and
			// again until EXHAUSTED: 10,000 calls).
			require.Less(t, failedCalls, total/4, "failed publishes during the outage")
			rows, err := s.DB.Query(`SELECT message_id, attempts FROM messaging_outbox`)
			require.NoError(t, err)
			defer rows.Close()
			down.mu.Lock()
			defer down.mu.Unlock()
			for rows.Next() {
				var id string
				var attempts int
				require.NoError(t, rows.Scan(&id, &attempts))
				require.LessOrEqual(t, attempts, 1+down.failed[id], "%s: attempts beyond the publishes it carried", id)
			}
			require.NoError(t, rows.Err())
		})
	}
}

// Two destinations, one down for the whole test: the other's rows all flow,
// and the down one's rows keep their budget (no attempts beyond the probes).
func TestOneDestinationDownTheOtherFlows(t *testing.T) {
	s := newDB(t)
	rows := make([]testdb.OutboxRow, 0, 600)
	for g := 1; g <= 600; g++ {
		id, dest := "b"+strconv.Itoa(g), "up"
		if g%2 == 0 {
			id, dest = "a"+strconv.Itoa(g), "down"
		}
		rows = append(rows, testdb.Row(envelope.Row{MessageID: id, Destination: dest, Payload: []byte{0}}))
	}
	testdb.InsertRows(t, s.DB, rows...)
	out := newOutage("down")
	rs := startRelays(t, s, out, 1, outageConfig())
	await.Until(t, func() bool {
		var n int
		require.NoError(t, s.DB.QueryRow(`SELECT count(*) FROM messaging_outbox WHERE destination = 'up' AND status = 'PUBLISHED'`).Scan(&n))
		return n == 300
	}, "the healthy destination's rows all go out")
	require.True(t, rs.sawOpen("down"))
	require.NoError(t, rs.fs[0].Ready(), "one destination is healthy: the relay is ready")
	rs.stop(t)
	var parked, maxAttempts int
	require.NoError(t, s.DB.QueryRow(`SELECT count(*) FILTER (WHERE parked_at IS NOT NULL), coalesce(max(attempts), 0)
		FROM messaging_outbox WHERE destination = 'down'`).Scan(&parked, &maxAttempts))
	require.Zero(t, parked)
	_, failedCalls := out.counts()
	require.Less(t, failedCalls, 150, "the down destination's backlog was not tried row by row")
	require.LessOrEqual(t, maxAttempts, failedCalls)
}

// A poison message (failing on its own while the rest of its destination
// goes through) still ends EXHAUSTED after its budget, and never opens the
// breaker.
func TestPoisonMessageExhaustsWithoutOpeningTheBreaker(t *testing.T) {
	s := newDB(t)
	fill(t, s, "orders", "good", 200)
	insertN(t, s.DB, "orders", "poison")
	out := newOutage()
	out.failWith = func(_ string, m *message.Message) (bool, error) {
		if m.UUID == "poison" {
			return false, errors.New("serializer: field 7 out of range")
		}
		return false, nil
	}
	cfg := outageConfig()
	cfg.MaxAttempts = 4
	rs := startRelays(t, s, out, 1, cfg)
	await.Until(t, func() bool {
		st := statusCounts(t, s)
		return st["PUBLISHED"] == 200 && st["EXHAUSTED"] == 1
	}, "every row published and the poison message parked")
	rs.stop(t)
	require.Equal(t, 4, state(t, s.DB, "poison").Attempts)
	require.False(t, rs.sawOpen("orders"), "a poison message is not an outage")
}

// A downstream that takes every message and then times out (ambiguous, not
// unavailable) opens the breaker too; the rows it had already taken spent an
// attempt each and are reported as possible duplicates when they go out
// again.
func TestAmbiguousDownstreamOpensTheBreaker(t *testing.T) {
	s := newDB(t)
	fill(t, s, "orders", "m", 40)
	var hanging atomic.Bool
	hanging.Store(true)
	release := make(chan struct{})
	t.Cleanup(func() { close(release) })
	out := newOutage()
	out.failWith = func(_ string, m *message.Message) (bool, error) {
		if hanging.Load() {
			return true, fmt.Errorf("timeout waiting for the broker's confirm of %s", m.UUID)
		}
		return false, nil
	}
	cfg := outageConfig()
	cfg.Classifier = func(err error) forwarder.Verdict { // a transport that knows it timed out after sending
		return forwarder.Verdict{Outcome: forwarder.Ambiguous, Code: "CONFIRM_TIMEOUT"}
	}
	rs := startRelays(t, s, out, 1, cfg)
	await.Until(t, func() bool { return rs.sawOpen("orders") }, "the breaker opens")
	hanging.Store(false)
	await.Until(t, func() bool { return statusCounts(t, s)["PUBLISHED"] == 40 }, "every row published once the downstream answers")
	rs.stop(t)
	var tried int
	require.NoError(t, s.DB.QueryRow(`SELECT count(*) FROM messaging_outbox WHERE attempts > 1`).Scan(&tried))
	require.Positive(t, tried, "the rows the downstream took spent an attempt")
	require.Equal(t, tried, rs.total(func(r forwarder.Report) int { return r.PossibleDuplicates }),
		"each of them is reported as a possible duplicate when it goes out again")
}

func assertEventually(t *testing.T, cond func() bool, within time.Duration) bool {
	deadline := time.Now().Add(within)
	for time.Now().Before(deadline) {
		if cond() {
			return true
		}
		time.Sleep(10 * time.Millisecond)
	}
	return cond()
}

// Operators see an open breaker: status (what outboxctl status prints) lists
// it with its destination, owner and last error while the destination is
// down, and no longer once a probe was confirmed; the gauge follows.
func TestOpenBreakerIsVisibleToOperators(t *testing.T) {
	s := newDB(t)
	fill(t, s, "orders", "m", 50)
	down := newOutage("orders")
	reg := prometheus.NewRegistry()
	cfg := outageConfig()
	cfg.Owner, cfg.Metrics = "relay-visible", promMetrics(t, reg)
	rs := startRelays(t, s, down, 1, cfg)
	await.Until(t, func() bool {
		snap, err := status.Collect(context.Background(), s.DB)
		require.NoError(t, err)
		return len(snap.Breakers) == 1
	}, "status shows the open breaker")
	snap, err := status.Collect(context.Background(), s.DB)
	require.NoError(t, err)
	b := snap.Breakers[0]
	require.Equal(t, "orders", b.Destination)
	require.Equal(t, "relay-visible", b.Owner)
	require.Contains(t, b.LastError, "connection refused")
	require.Equal(t, 1.0, gauge(t, reg, "orders"))

	down.set("orders", false)
	await.Until(t, func() bool { return statusCounts(t, s)["PUBLISHED"] == 50 }, "every row published once the destination is back")
	await.Until(t, func() bool {
		snap, err := status.Collect(context.Background(), s.DB)
		require.NoError(t, err)
		return len(snap.Breakers) == 0
	}, "the closed breaker leaves status")
	require.Equal(t, 0.0, gauge(t, reg, "orders"))
	rs.stop(t)
}

// gauge is the breaker_open value of dest in reg.
func gauge(t *testing.T, reg *prometheus.Registry, dest string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != forwarder.MetricBreakerOpen {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "destination" && l.GetValue() == dest {
					return m.GetGauge().GetValue()
				}
			}
		}
	}
	t.Fatalf("no %s{destination=%q}", forwarder.MetricBreakerOpen, dest)
	return 0
}

// When a destination's breaker closes, the rows given back during its
// outage are claimable at once. Their hold-off grows with the time the
// breaker has been open (so probes take other rows); without ending it, a
// row given back late in a ten-minute outage waited about ten minutes more
// after the downstream was back (bench: a 60 s outage emptied 45.6 s after
// recovery, where draining took 1.8 s).
func TestRowsHeldOffDuringAnOutageGoOutWhenTheBreakerCloses(t *testing.T) {
	s := newDB(t)
	for i := range 10 {
		insertN(t, s.DB, "orders", fmt.Sprintf("m%d", i))
	}
	clk := newClock()
	var down atomic.Bool
	down.Store(true)
	rec := &recorder{behave: func(string, *message.Message) (bool, error) {
		if down.Load() {
			return false, forwarder.MarkUnavailable(errBroker)
		}
		return true, nil
	}}
	f := newForwarder(t, s.DB, rec, forwarder.Config{Now: clk.Now})
	ctx := context.Background()
	_, err := f.RunOnce(ctx) // the outage opens the breaker
	require.NoError(t, err)
	require.Error(t, f.Ready())
	clk.Advance(10 * time.Minute)
	_, err = f.RunOnce(ctx) // a probe, refused: its row is held off
	require.NoError(t, err)
	var held int
	require.NoError(t, s.DB.QueryRow(`SELECT count(*) FROM messaging_outbox WHERE next_attempt_at > $1`, clk.Now().Add(5*time.Minute)).Scan(&held))
	require.Positive(t, held, "a row given back during the outage is held off for about as long as the breaker has been open")

	down.Store(false)
	clk.Advance(time.Minute) // the next probe is due (BreakerProbeMax 30 s); the hold-off is not over
	for passes := 0; statusCounts(t, s)["PUBLISHED"] < 10; passes++ {
		require.Less(t, passes, 4, "every row goes out within a few passes of the breaker closing, the held-off ones too")
		_, err := f.RunOnce(ctx)
		require.NoError(t, err)
	}
	require.NoError(t, f.Ready())
}

// DOWNSTREAM_FAILING (docs/ERRORS.md): with the default classifier, a pass
// in which every publish to a destination failed the same way, on two
// messages or more, puts those rows back without an attempt, marked
// DOWNSTREAM_FAILING and held off; once the destination takes them they are
// counted as possible duplicates (the broker may have taken them before).
func TestAPassWhoseEveryPublishFailsAlikeIsDownstreamFailing(t *testing.T) {
	ctx := context.Background()
	s := newDB(t)
	insertN(t, s.DB, "orders", "a", "b", "c")
	clk := newClock()
	var down atomic.Bool
	down.Store(true)
	rec := &recorder{behave: func(string, *message.Message) (bool, error) {
		if down.Load() {
			return false, errors.New("broker: connection reset")
		}
		return true, nil
	}}
	f := newForwarder(t, s.DB, rec, forwarder.Config{Now: clk.Now})
	rep, _ := f.RunOnce(ctx)
	require.Equal(t, 3, rep.Unavailable)
	// Three messages, fewer than BreakerThreshold (5): the pass-wide rule
	// opened the breaker, not the count.
	require.Len(t, rep.OpenBreakers, 1, "one pass of alike failures opens the breaker")
	require.Equal(t, "orders", rep.OpenBreakers[0].Destination)
	for _, id := range []string{"a", "b", "c"} {
		st := state(t, s.DB, id)
		require.Equal(t, "PENDING", st.Status, id)
		require.Equal(t, forwarder.FailureDownstreamFailing, st.Code, id)
		require.Zero(t, st.Attempts, "%s: no attempt spent", id)
		require.True(t, st.Next.Valid, "%s: held off", id)
	}

	down.Store(false)
	clk.Advance(forwarder.DefaultBreakerProbeMax + time.Second)
	possible := 0
	for passes := 0; len(rec.ids()) < 3; passes++ { // the recorder keeps deliveries only
		require.Less(t, passes, 10, "the rows go out once the destination is back")
		rep, err := f.RunOnce(ctx)
		require.NoError(t, err)
		possible += rep.PossibleDuplicates
	}
	require.Equal(t, 3, possible, "each may have been taken by the broker before")
	require.ElementsMatch(t, []string{"a", "b", "c"}, rec.ids())
}
