package forwarder_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/forwarder"
)

const messagesHeader = `
# HELP outbox_forwarder_messages_total Rows the forwarder finished a pass with, by outcome and destination.
# TYPE outbox_forwarder_messages_total counter
`

func requireMessages(t *testing.T, reg prometheus.Gatherer, series string) {
	t.Helper()
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(messagesHeader+series), forwarder.MetricMessages))
}

// The outcome labels other than published/ambiguous/failed: stale (a
// superseded relay's write), released (rows not started when the relay
// stops), exhausted (the budget spent by a publish, or found spent by the
// claim) and unavailable (put back without an attempt: the downstream was
// down as a whole).
func TestMetricsCountStaleReleasedExhaustedAndUnavailable(t *testing.T) {
	t.Run("stale", func(t *testing.T) {
		ctx := context.Background()
		s := newDB(t)
		clk := newClock()
		insertN(t, s.DB, "orders", "m1")
		fB := newForwarder(t, s.DB, &recorder{}, forwarder.Config{Owner: "relay-b", Now: clk.Now})
		// A stalls past its lease while B reclaims and publishes the row.
		recA := &recorder{behave: func(string, *message.Message) (bool, error) {
			clk.Advance(31 * time.Second)
			rep, err := fB.RunOnce(ctx)
			require.NoError(t, err)
			require.Equal(t, 1, rep.Published)
			return true, nil
		}}
		regA := prometheus.NewPedanticRegistry()
		fA := newForwarder(t, s.DB, recA, forwarder.Config{Owner: "relay-a", Now: clk.Now, Metrics: promMetrics(t, regA)})
		rep, err := fA.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 1, rep.Stale)
		requireMessages(t, regA, `outbox_forwarder_messages_total{destination="orders",outcome="stale"} 1
`)
	})

	t.Run("released", func(t *testing.T) {
		s := newDB(t)
		insertN(t, s.DB, "orders", "m1", "m2", "m3")
		insertN(t, s.DB, "payments", "p1")
		h := newHanger(t)
		reg := prometheus.NewPedanticRegistry()
		f := newForwarder(t, s.DB, h, forwarder.Config{
			Concurrency: 1, PublishTimeout: 5 * time.Second, DrainTimeout: 100 * time.Millisecond, Metrics: promMetrics(t, reg),
		})
		runErr := make(chan error, 1)
		go func() { runErr <- f.Run(context.Background()) }()
		first := waitOrFail(t, h.entered, "the first publish")
		require.NoError(t, f.Close())
		require.NoError(t, waitOrFail(t, runErr, "Run returning"))
		require.Zero(t, s.Count(t, "status = 'IN_FLIGHT'"))
		// Rows are claimed in seq order and published one at a time, so the
		// one in progress is m1; the other three are released.
		require.Equal(t, "m1", first)
		requireMessages(t, reg, `outbox_forwarder_messages_total{destination="orders",outcome="ambiguous"} 1
outbox_forwarder_messages_total{destination="orders",outcome="released"} 2
outbox_forwarder_messages_total{destination="payments",outcome="released"} 1
`)
	})

	t.Run("exhausted", func(t *testing.T) {
		s := newDB(t)
		insertN(t, s.DB, "orders", "spent-by-publish", "spent-before-claim")
		// A row whose budget was already spent (MaxAttempts lowered since)
		// is parked by the claim itself, never handed to the publisher.
		_, err := s.DB.Exec(`UPDATE messaging_outbox SET status = 'AMBIGUOUS', attempts = 7 WHERE message_id = 'spent-before-claim'`)
		require.NoError(t, err)
		rec := &recorder{behave: func(string, *message.Message) (bool, error) { return true, errBroker }}
		reg := prometheus.NewPedanticRegistry()
		f := newForwarder(t, s.DB, rec, forwarder.Config{MaxAttempts: 1, Metrics: promMetrics(t, reg)})
		rep, err := f.RunOnce(context.Background())
		require.NoError(t, err)
		require.Equal(t, 2, rep.Exhausted)
		require.Equal(t, []string{"spent-by-publish"}, rec.ids())
		requireMessages(t, reg, `outbox_forwarder_messages_total{destination="orders",outcome="exhausted"} 2
`)
		require.Equal(t, 2, s.Count(t, "status = 'EXHAUSTED'"))
	})

	t.Run("unavailable", func(t *testing.T) {
		s := newDB(t)
		insertN(t, s.DB, "orders", "m1")
		rec := &recorder{behave: func(string, *message.Message) (bool, error) {
			return false, forwarder.MarkUnavailable(errBroker)
		}}
		reg := prometheus.NewPedanticRegistry()
		f := newForwarder(t, s.DB, rec, forwarder.Config{Metrics: promMetrics(t, reg)})
		rep, err := f.RunOnce(context.Background())
		require.NoError(t, err)
		require.Equal(t, 1, rep.Unavailable)
		requireMessages(t, reg, `outbox_forwarder_messages_total{destination="orders",outcome="unavailable"} 1
`)
		// Put back without an attempt, with the code operators read.
		var status, code string
		var attempts int
		require.NoError(t, s.DB.QueryRow(`SELECT status, attempts, last_failure_code FROM messaging_outbox WHERE message_id = 'm1'`).Scan(&status, &attempts, &code))
		require.Equal(t, "PENDING", status)
		require.Zero(t, attempts)
		require.Equal(t, forwarder.FailureDownstreamUnavailable, code)
	})
}
