package forwarder

import (
	"errors"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Metric names. Labels are bounded: outcome is one of published, ambiguous,
// failed, exhausted, stale, released; destination is the topic (a set fixed
// by the application). The message id is never a label.
const (
	MetricMessages        = "outbox_forwarder_messages_total"
	MetricPassFailures    = "outbox_forwarder_pass_failures_total"
	MetricPasses          = "outbox_forwarder_passes_total"
	MetricPublishDuration = "outbox_forwarder_publish_duration_seconds"
	MetricClaimBatchSize  = "outbox_forwarder_claim_batch_size"
	MetricBreakerOpen     = "outbox_forwarder_breaker_open"
)

type metrics struct {
	messages        *prometheus.CounterVec
	passFailures    prometheus.Counter
	passes          prometheus.Counter
	publishDuration *prometheus.HistogramVec
	claimBatch      prometheus.Histogram
	breakerOpen     *prometheus.GaugeVec
}

func newMetrics(reg prometheus.Registerer, batchSize int) (*metrics, error) {
	if reg == nil {
		return nil, nil
	}
	m := &metrics{
		messages: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: MetricMessages,
			Help: "Rows the forwarder finished a pass with, by outcome and destination.",
		}, []string{"outcome", "destination"}),
		passFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: MetricPassFailures,
			Help: "Passes that failed (database unreachable, outcome write failed, unknown outcome).",
		}),
		passes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: MetricPasses,
			Help: "Passes run, failing or not.",
		}),
		publishDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    MetricPublishDuration,
			Help:    "Time spent in the downstream Publish, by destination.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 16),
		}, []string{"destination"}),
		claimBatch: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    MetricClaimBatchSize,
			Help:    "Rows returned by one claim.",
			Buckets: prometheus.LinearBuckets(0, float64(max(batchSize/10, 1)), 11),
		}),
		breakerOpen: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: MetricBreakerOpen,
			Help: "1 while the destination's breaker is open (the downstream is unavailable as a whole), 0 once it closed.",
		}, []string{"destination"}),
	}
	var err error
	m.breakerOpen = register(reg, m.breakerOpen, &err)
	m.messages = register(reg, m.messages, &err)
	m.passFailures = register(reg, m.passFailures, &err)
	m.passes = register(reg, m.passes, &err)
	m.publishDuration = register(reg, m.publishDuration, &err)
	m.claimBatch = register(reg, m.claimBatch, &err)
	return m, err
}

// register adds c to reg, or returns the collector already registered under
// the same name (two forwarders in one process share their series).
func register[C prometheus.Collector](reg prometheus.Registerer, c C, errp *error) C {
	if err := reg.Register(c); err != nil {
		var are prometheus.AlreadyRegisteredError
		if errors.As(err, &are) {
			if existing, ok := are.ExistingCollector.(C); ok {
				return existing
			}
		}
		if *errp == nil {
			*errp = err
		}
	}
	return c
}

func (m *metrics) message(outcome, destination string) {
	if m != nil {
		m.messages.WithLabelValues(outcome, destination).Inc()
	}
}

func (m *metrics) published(destination string, d time.Duration) {
	if m != nil {
		m.publishDuration.WithLabelValues(destination).Observe(d.Seconds())
	}
}

func (m *metrics) pass(claimed int, failed bool) {
	if m == nil {
		return
	}
	m.passes.Inc()
	m.claimBatch.Observe(float64(claimed))
	if failed {
		m.passFailures.Inc()
	}
}

func (m *metrics) breaker(destination string, open bool) {
	if m == nil {
		return
	}
	v := 0.0
	if open {
		v = 1
	}
	m.breakerOpen.WithLabelValues(destination).Set(v)
}
