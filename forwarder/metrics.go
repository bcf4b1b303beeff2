package forwarder

import "time"

// Metric names of the Prometheus implementation (forwarder/prommetrics),
// with its default namespace "outbox". Labels are bounded: outcome is one of
// published, ambiguous, failed, exhausted, unavailable, stale, released;
// destination is the topic, capped by prommetrics.Options.MaxDestinations
// (the rest are counted under "_other"). The message id is never a label.
const (
	MetricMessages        = "outbox_forwarder_messages_total"
	MetricPassFailures    = "outbox_forwarder_pass_failures_total"
	MetricPasses          = "outbox_forwarder_passes_total"
	MetricPublishDuration = "outbox_forwarder_publish_duration_seconds"
	MetricClaimBatchSize  = "outbox_forwarder_claim_batch_size"
	MetricBreakerOpen     = "outbox_forwarder_breaker_open"
	// MetricFailedClaims counts claim statements that failed (and may have
	// committed), MetricFailedClaimReleased the rows released because of
	// them (Report.ClaimFailures, Report.ClaimReleased).
	MetricFailedClaims        = "outbox_forwarder_failed_claims_total"
	MetricFailedClaimReleased = "outbox_forwarder_failed_claim_released_total"
	// MetricUnrecordedPublishes counts rows confirmed downstream whose
	// outcome write failed: possible duplicates (Report.UnrecordedPublishes).
	MetricUnrecordedPublishes = "outbox_forwarder_unrecorded_publishes_total"
	// MetricAbandonedPublishes is the number of publishes left running after
	// their timeout at the start of the last pass; MetricClaimsPaused counts
	// passes that claimed nothing because it exceeded Config.MaxAbandoned.
	MetricAbandonedPublishes = "outbox_forwarder_abandoned_publishes"
	MetricClaimsPaused       = "outbox_forwarder_claims_paused_total"
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
	// Contained receives, once per pass, what the pass contained rather
	// than lost: claims that failed after they were sent and the rows
	// released because of them, confirmed publishes whose outcome write
	// failed, the publishes left behind still running and whether the pass
	// paused claiming because of them.
	Contained(c Containment)
}

// Containment is what Metrics.Contained receives (the Report fields of the
// same names).
type Containment struct {
	ClaimFailures, ClaimReleased, UnrecordedPublishes, AbandonedPublishes int
	ClaimPaused                                                           bool
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

func (m *metrics) contained(r Report) {
	if m != nil {
		m.m.Contained(Containment{
			ClaimFailures: r.ClaimFailures, ClaimReleased: r.ClaimReleased,
			UnrecordedPublishes: r.UnrecordedPublishes, AbandonedPublishes: r.AbandonedPublishes,
			ClaimPaused: r.ClaimPaused,
		})
	}
}

func (m *metrics) breaker(destination string, open bool) {
	if m != nil {
		m.m.Breaker(destination, open)
	}
}
