// Package prommetrics is the Prometheus implementation of forwarder.Metrics:
//
//	m, err := prommetrics.New(prometheus.DefaultRegisterer, prommetrics.Options{})
//	fwd, err := forwarder.New(db, out, forwarder.Config{Metrics: m})
//
// Series (with the default namespace "outbox"):
// outbox_forwarder_messages_total{outcome,destination},
// outbox_forwarder_publish_duration_seconds{destination},
// outbox_forwarder_passes_total, outbox_forwarder_pass_failures_total and
// outbox_forwarder_claim_batch_size.
//
// The destination label is bounded: the first MaxDestinations destinations
// seen (default 50) get their own series, every later one is counted under
// "_other", so an application that derives topics from data cannot grow the
// series without limit. This is the same cap, and the same "_other", as the
// status collector's CollectorOptions.MaxDestinations.
package prommetrics

import (
	"cmp"
	"errors"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
)

// OtherDestination is the destination label of every destination beyond
// Options.MaxDestinations.
const OtherDestination = "_other"

// DefaultMaxDestinations is the cap when Options.MaxDestinations is 0.
const DefaultMaxDestinations = 50

// Options configure the collectors. The zero value gives the documented
// names and a cap of 50 destinations.
type Options struct {
	// Namespace prefixes the metric names (namespace_forwarder_...).
	// Default "outbox", which gives the forwarder.Metric* names. It must be
	// a classic Prometheus name: a letter or underscore, then letters,
	// digits and underscores.
	Namespace string
	// ConstLabels are added to every series (for example the relay's
	// deployment or shard). Their names must be classic Prometheus label
	// names (a letter or underscore, then letters, digits and underscores,
	// not starting with "__") other than the labels the collectors use
	// themselves: "outcome", "destination" and the histograms' "le".
	ConstLabels prometheus.Labels
	// MaxDestinations caps the destination label values: destinations
	// beyond the first MaxDestinations seen are counted under "_other".
	// Default 50; must be >= 0.
	MaxDestinations int
	// BatchSize is the largest claim the forwarder makes (its
	// Config.MaxBatchSize), for the buckets of the claim batch size
	// histogram. Default forwarder.DefaultMaxBatchSize.
	BatchSize int
}

// classicName is a Prometheus metric name prefix or label name in the
// classic character set, which every scraper and query accepts unquoted.
var classicName = regexp.MustCompile(`^[a-zA-Z_][a-zA-Z0-9_]*$`)

// reservedLabels are the label names the collectors set themselves: a
// constant label of one of these names is refused (by NewHistogram with a
// panic, for "le").
var reservedLabels = []string{"outcome", "destination", "le"}

// Metrics is a forwarder.Metrics on Prometheus collectors.
type Metrics struct {
	messages        *prometheus.CounterVec
	passFailures    prometheus.Counter
	passes          prometheus.Counter
	publishDuration *prometheus.HistogramVec
	claimBatch      prometheus.Histogram
	breakerOpen     *prometheus.GaugeVec
	failedClaims    prometheus.Counter
	claimReleased   prometheus.Counter
	unrecorded      prometheus.Counter
	abandoned       prometheus.Gauge
	claimsPaused    prometheus.Counter

	max   int
	mu    sync.RWMutex
	known map[string]struct{}
}

var _ forwarder.Metrics = (*Metrics)(nil)

// New registers the collectors on reg. Two forwarders in one process may
// share reg: the second gets the collectors already registered (with the
// same options), so their series add up. A nil reg, a negative
// MaxDestinations or BatchSize, a Namespace or ConstLabels name that is not
// a classic Prometheus name, or a ConstLabels name the collectors use
// themselves (see Options) is refused with OUTBOX_INVALID_CONFIG.
func New(reg prometheus.Registerer, o Options) (*Metrics, error) {
	const op = "prommetrics.New"
	if reg == nil {
		return nil, outbox.Errorf(outbox.CodeInvalidConfig, op, "reg is nil; leave forwarder.Config.Metrics nil for no metrics")
	}
	if o.MaxDestinations < 0 || o.BatchSize < 0 {
		return nil, outbox.Errorf(outbox.CodeInvalidConfig, op, "MaxDestinations and BatchSize must be >= 0 (0 = default)")
	}
	// Checked before any collector is built: prometheus.NewHistogram panics
	// on a constant "le" label instead of returning an error.
	if o.Namespace != "" && !classicName.MatchString(o.Namespace) {
		return nil, outbox.Errorf(outbox.CodeInvalidConfig, op,
			"Namespace %q is not a Prometheus metric name prefix; use letters, digits and underscores, not starting with a digit", o.Namespace)
	}
	for l := range o.ConstLabels {
		switch {
		case !classicName.MatchString(l) || strings.HasPrefix(l, "__"):
			return nil, outbox.Errorf(outbox.CodeInvalidConfig, op,
				"ConstLabels name %q is not a Prometheus label name; use letters, digits and underscores, not starting with a digit or \"__\"", l)
		case slices.Contains(reservedLabels, l):
			return nil, outbox.Errorf(outbox.CodeInvalidConfig, op,
				"ConstLabels name %q is a label the forwarder's collectors set themselves (%s); rename it", l, strings.Join(reservedLabels, ", "))
		}
	}
	ns := cmp.Or(o.Namespace, "outbox")
	name := func(metric string) string { return ns + strings.TrimPrefix(metric, "outbox") }
	batch := cmp.Or(o.BatchSize, forwarder.DefaultMaxBatchSize)
	m := &Metrics{
		messages: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name:        name(forwarder.MetricMessages),
			Help:        "Rows the forwarder finished a pass with, by outcome and destination.",
			ConstLabels: o.ConstLabels,
		}, []string{"outcome", "destination"}),
		passFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Name:        name(forwarder.MetricPassFailures),
			Help:        "Passes that failed (database unreachable, outcome write failed, unknown outcome).",
			ConstLabels: o.ConstLabels,
		}),
		passes: prometheus.NewCounter(prometheus.CounterOpts{
			Name:        name(forwarder.MetricPasses),
			Help:        "Passes run, failing or not.",
			ConstLabels: o.ConstLabels,
		}),
		publishDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:        name(forwarder.MetricPublishDuration),
			Help:        "Time spent in the downstream Publish, by destination.",
			Buckets:     prometheus.ExponentialBuckets(0.001, 2, 16),
			ConstLabels: o.ConstLabels,
		}, []string{"destination"}),
		claimBatch: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:        name(forwarder.MetricClaimBatchSize),
			Help:        "Rows returned by one claim.",
			Buckets:     prometheus.LinearBuckets(0, float64(max(batch/10, 1)), 11),
			ConstLabels: o.ConstLabels,
		}),
		breakerOpen: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name:        name(forwarder.MetricBreakerOpen),
			Help:        "Open breakers by destination: 1 while the destination's downstream is unavailable as a whole (its rows wait without spending attempts), 0 once it closed; under " + OtherDestination + ", how many of the destinations past the cap are open.",
			ConstLabels: o.ConstLabels,
		}, []string{"destination"}),
		failedClaims: prometheus.NewCounter(prometheus.CounterOpts{
			Name:        name(forwarder.MetricFailedClaims),
			Help:        "Claim statements that failed (a row that could not be read, a timeout, a lost connection): they may have committed, so the rows they may hold are released.",
			ConstLabels: o.ConstLabels,
		}),
		claimReleased: prometheus.NewCounter(prometheus.CounterOpts{
			Name:        name(forwarder.MetricFailedClaimReleased),
			Help:        "Rows released without an attempt after a claim failed once sent, instead of waiting for their leases to expire.",
			ConstLabels: o.ConstLabels,
		}),
		unrecorded: prometheus.NewCounter(prometheus.CounterOpts{
			Name:        name(forwarder.MetricUnrecordedPublishes),
			Help:        "Rows confirmed downstream whose outcome write failed: they are published again after their leases expire (possible duplicates).",
			ConstLabels: o.ConstLabels,
		}),
		abandoned: prometheus.NewGauge(prometheus.GaugeOpts{
			Name:        name(forwarder.MetricAbandonedPublishes),
			Help:        "Publishes left running after their timeout (a downstream that ignores its context), at the start of the last pass.",
			ConstLabels: o.ConstLabels,
		}),
		claimsPaused: prometheus.NewCounter(prometheus.CounterOpts{
			Name:        name(forwarder.MetricClaimsPaused),
			Help:        "Passes that claimed nothing because more publishes than MaxAbandoned were left running.",
			ConstLabels: o.ConstLabels,
		}),
		max:   cmp.Or(o.MaxDestinations, DefaultMaxDestinations),
		known: map[string]struct{}{},
	}
	var err error
	m.messages = register(reg, m.messages, &err)
	m.passFailures = register(reg, m.passFailures, &err)
	m.passes = register(reg, m.passes, &err)
	m.publishDuration = register(reg, m.publishDuration, &err)
	m.claimBatch = register(reg, m.claimBatch, &err)
	m.breakerOpen = register(reg, m.breakerOpen, &err)
	m.failedClaims = register(reg, m.failedClaims, &err)
	m.claimReleased = register(reg, m.claimReleased, &err)
	m.unrecorded = register(reg, m.unrecorded, &err)
	m.abandoned = register(reg, m.abandoned, &err)
	m.claimsPaused = register(reg, m.claimsPaused, &err)
	if err != nil {
		return nil, outbox.Wrap(outbox.CodeInvalidConfig, op, err, "register the forwarder's collectors")
	}
	return m, nil
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

// destination is d while fewer than max destinations have been seen or d is
// one of them, OtherDestination otherwise. Two Metrics sharing collectors
// keep their own sets, so the bound holds per forwarder.
func (m *Metrics) destination(d string) string {
	m.mu.RLock()
	_, ok := m.known[d]
	n := len(m.known)
	m.mu.RUnlock()
	if ok {
		return d
	}
	if n >= m.max {
		return OtherDestination
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, ok := m.known[d]; ok {
		return d
	}
	if len(m.known) >= m.max {
		return OtherDestination
	}
	m.known[d] = struct{}{}
	return d
}

// Message implements forwarder.Metrics.
func (m *Metrics) Message(outcome, destination string) {
	m.messages.WithLabelValues(outcome, m.destination(destination)).Inc()
}

// Published implements forwarder.Metrics.
func (m *Metrics) Published(destination string, d time.Duration) {
	m.publishDuration.WithLabelValues(m.destination(destination)).Observe(d.Seconds())
}

// Pass implements forwarder.Metrics.
func (m *Metrics) Pass(claimed int, failed bool) {
	m.passes.Inc()
	m.claimBatch.Observe(float64(claimed))
	if failed {
		m.passFailures.Inc()
	}
}

// Breaker moves the destination's breaker_open gauge: up when it opens, down
// when it closes (a destination past the cap shares the _other series, which
// then counts its open breakers).
func (m *Metrics) Breaker(destination string, open bool) {
	g := m.breakerOpen.WithLabelValues(m.destination(destination))
	if open {
		g.Inc()
		return
	}
	g.Dec()
}

// Contained implements forwarder.Metrics.
func (m *Metrics) Contained(c forwarder.Containment) {
	m.failedClaims.Add(float64(c.ClaimFailures))
	m.claimReleased.Add(float64(c.ClaimReleased))
	m.unrecorded.Add(float64(c.UnrecordedPublishes))
	m.abandoned.Set(float64(c.AbandonedPublishes))
	if c.ClaimPaused {
		m.claimsPaused.Inc()
	}
}
