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
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/spanrec"
)

func TestMetricsCountOutcomesByDestination(t *testing.T) {
	s := newDB(t)
	insertN(t, s.DB, "orders", "ok1", "ok2", "amb")
	insertN(t, s.DB, "payments", "rej")
	rec := &recorder{behave: func(_ string, m *message.Message) (bool, error) {
		switch m.UUID {
		case "amb":
			return false, errBroker
		case "rej":
			return false, forwarder.Reject(errBroker, "NO")
		}
		return true, nil
	}}
	reg := prometheus.NewPedanticRegistry()
	f := newForwarder(t, s.DB, rec, forwarder.Config{Metrics: promMetrics(t, reg)})
	_, err := f.RunOnce(context.Background())
	require.NoError(t, err)

	// A second forwarder in the same process shares the series.
	_ = newForwarder(t, s.DB, rec, forwarder.Config{Metrics: promMetrics(t, reg)})

	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP outbox_forwarder_messages_total Rows the forwarder finished a pass with, by outcome and destination.
# TYPE outbox_forwarder_messages_total counter
outbox_forwarder_messages_total{destination="orders",outcome="ambiguous"} 1
outbox_forwarder_messages_total{destination="orders",outcome="published"} 2
outbox_forwarder_messages_total{destination="payments",outcome="failed"} 1
# HELP outbox_forwarder_passes_total Passes run, failing or not.
# TYPE outbox_forwarder_passes_total counter
outbox_forwarder_passes_total 1
# HELP outbox_forwarder_pass_failures_total Passes that failed (database unreachable, outcome write failed, unknown outcome).
# TYPE outbox_forwarder_pass_failures_total counter
outbox_forwarder_pass_failures_total 0
`), forwarder.MetricMessages, forwarder.MetricPasses, forwarder.MetricPassFailures))
	n, err := testutil.GatherAndCount(reg, forwarder.MetricPublishDuration)
	require.NoError(t, err)
	require.Equal(t, 2, n, "one latency series per destination, never per message")
	n, err = testutil.GatherAndCount(reg, forwarder.MetricClaimBatchSize)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	problems, err := testutil.GatherAndLint(reg)
	require.NoError(t, err)
	require.Empty(t, problems)
}

func TestAFailingPassIsCountedAndTheLoopGoesOn(t *testing.T) {
	s := newDB(t)
	db := s.Open(t)
	reg := prometheus.NewRegistry()
	passes := make(chan struct{}, 100)
	f := newForwarder(t, db, &recorder{}, forwarder.Config{
		Metrics:     promMetrics(t, reg),
		BackoffBase: time.Millisecond, BackoffMax: 2 * time.Millisecond, PollInterval: time.Millisecond,
		MaxPollInterval: 2 * time.Millisecond,
		OnReport: func(forwarder.Report) {
			select {
			case passes <- struct{}{}:
			default:
			}
		},
	})
	done := make(chan error, 1)
	go func() { done <- f.Run(context.Background()) }()
	<-f.Running()
	// The relay's database goes away under it: every pass now fails.
	require.NoError(t, db.Close())
	require.Eventually(t, func() bool {
		return failures(t, reg) >= 5
	}, 10*time.Second, time.Millisecond, "passes keep coming after the database went away")
	require.NoError(t, f.Close())
	require.NoError(t, <-done)
}

func failures(t *testing.T, reg *prometheus.Registry) float64 {
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() == forwarder.MetricPassFailures {
			return mf.GetMetric()[0].GetCounter().GetValue()
		}
	}
	return 0
}

func TestPublishContinuesTheStoredTrace(t *testing.T) {
	s := newDB(t)
	const traceID, parentSpan = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
	m := message.NewMessage("traced", []byte("x"))
	m.Metadata.Set(envelope.KeyTraceparent, "00-"+traceID+"-"+parentSpan+"-01")
	insert(t, s.DB, "orders", m)

	tp := spanrec.New() // the core module does not require the OTel SDK
	sr := tp
	rec := &recorder{}
	f := newForwarder(t, s.DB, rec, forwarder.Config{TracerProvider: tp})
	_, err := f.RunOnce(context.Background())
	require.NoError(t, err)

	spans := sr.Ended()
	require.Len(t, spans, 1)
	sp := spans[0]
	require.Equal(t, "outbox.publish orders", sp.Name())
	require.Equal(t, trace.SpanKindProducer, sp.SpanKind())
	require.Equal(t, traceID, sp.SpanContext().TraceID().String(), "the producer's trace continues")
	require.Equal(t, parentSpan, sp.Parent().SpanID().String())
	attrs := map[attribute.Key]attribute.Value{}
	for _, kv := range sp.Attributes() {
		attrs[kv.Key] = kv.Value
	}
	require.Equal(t, "traced", attrs["messaging.message.id"].AsString())
	require.Equal(t, "orders", attrs["messaging.destination.name"].AsString())
	require.Equal(t, int64(1), attrs["outbox.attempt"].AsInt64())

	// The message handed downstream carries the publish span, so publishers
	// that propagate context keep the trace.
	rec.mu.Lock()
	defer rec.mu.Unlock()
	require.Len(t, rec.delivered, 1)
	got := trace.SpanContextFromContext(rec.delivered[0].msg.Context())
	require.Equal(t, sp.SpanContext().SpanID(), got.SpanID())
}
