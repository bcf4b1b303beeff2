package forwarder

import "time"

// Metric names of the Prometheus implementation (forwarder/prommetrics),
// with its default namespace "outbox". Labels are bounded: outcome is one of
// published, ambiguous, failed, exhausted, stale, released; destination is
// the topic, capped by prommetrics.Options.MaxDestinations (the rest are
// counted under "_other"). The message id is never a label.
const (
	MetricMessages        = "outbox_forwarder_messages_total"
	MetricPassFailures    = "outbox_forwarder_pass_failures_total"
	MetricPasses          = "outbox_forwarder_passes_total"
	MetricPublishDuration = "outbox_forwarder_publish_duration_seconds"
	MetricClaimBatchSize  = "outbox_forwarder_claim_batch_size"
	MetricBreakerOpen     = "outbox_forwarder_breaker_open"
)

// Metrics receives the forwarder's measurements (Config.Metrics).
// prommetrics.New gives the Prometheus implementation; the forwarder package
// itself imports no metrics library, so a service that does not use
// Prometheus does not get it through the forwarder. Implementations must be
// safe for concurrent use: publish workers call them in parallel.
type Metrics interface {
	// Message counts a row the forwarder finished a pass with, by outcome
	// and destination.
	Message(outcome, destination string)
	// Published observes the time spent in one downstream Publish.
	Published(destination string, d time.Duration)
	// Pass counts a pass, the rows its claim returned, and whether it failed.
	Pass(claimed int, failed bool)
	// Breaker reports a destination's breaker opening (open) or closing.
	Breaker(destination string, open bool)
}

// metrics is the forwarder's nil-safe handle on Config.Metrics.
type metrics struct{ m Metrics }

func newMetrics(m Metrics, _ int) (*metrics, error) {
	if m == nil {
		return nil, nil
	}
	return &metrics{m: m}, nil
}

func (m *metrics) message(outcome, destination string) {
	if m != nil {
		m.m.Message(outcome, destination)
	}
}

func (m *metrics) published(destination string, d time.Duration) {
	if m != nil {
		m.m.Published(destination, d)
	}
}

func (m *metrics) pass(claimed int, failed bool) {
	if m != nil {
		m.m.Pass(claimed, failed)
	}
}

func (m *metrics) breaker(destination string, open bool) {
	if m != nil {
		m.m.Breaker(destination, open)
	}
}
