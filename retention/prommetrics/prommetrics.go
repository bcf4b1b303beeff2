// Package prommetrics is the Prometheus implementation of retention.Metrics:
//
//	m, err := prommetrics.New(prometheus.DefaultRegisterer, prommetrics.Options{})
//	c, err := retention.New(db, logger, retention.Config{Metrics: m})
//
// Series (with the default namespace "outbox"):
// outbox_retention_runs_total{result} (result "done", "skipped" or "failed":
// a run is skipped when another session holds the retention lock, so a
// rising "skipped" with no "done" means retention has stopped),
// outbox_retention_rows_total{action} (action "deleted", "archived",
// "archive_conflicts", "inbox_deleted"), and
// outbox_retention_last_done_timestamp_seconds (alert when it is old).
package prommetrics

import (
	"cmp"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/retention"
)

// Options configure the collectors; the zero value gives the documented
// names.
type Options struct {
	// Namespace prefixes the metric names (namespace_retention_...).
	// Default "outbox".
	Namespace string
	// ConstLabels are added to every series.
	ConstLabels prometheus.Labels
}

// Metrics is a retention.Metrics on Prometheus collectors.
type Metrics struct {
	runs     *prometheus.CounterVec
	rows     *prometheus.CounterVec
	lastDone prometheus.Gauge
}

var _ retention.Metrics = (*Metrics)(nil)

// New registers the collectors on reg.
func New(reg prometheus.Registerer, o Options) (*Metrics, error) {
	if reg == nil {
		return nil, outbox.Errorf(outbox.CodeInvalidConfig, "prommetrics.New", "reg is nil; leave retention.Config.Metrics nil for no metrics")
	}
	ns := cmp.Or(o.Namespace, "outbox")
	m := &Metrics{
		runs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Subsystem: "retention", Name: "runs_total", ConstLabels: o.ConstLabels,
			Help: "Retention runs by result: done, skipped (another session held the retention lock), failed.",
		}, []string{"result"}),
		rows: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Subsystem: "retention", Name: "rows_total", ConstLabels: o.ConstLabels,
			Help: "Rows retention removed or marked, by action: deleted, archived, archive_conflicts, inbox_deleted.",
		}, []string{"action"}),
		lastDone: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: ns, Subsystem: "retention", Name: "last_done_timestamp_seconds", ConstLabels: o.ConstLabels,
			Help: "Unix time of the last run that did its work (not skipped, not failed).",
		}),
	}
	for _, c := range []prometheus.Collector{m.runs, m.rows, m.lastDone} {
		if err := reg.Register(c); err != nil {
			return nil, outbox.Wrap(outbox.CodeInvalidConfig, "prommetrics.New", err, "register the retention collectors")
		}
	}
	for _, r := range []string{"done", "skipped", "failed"} {
		m.runs.WithLabelValues(r) // every series exists from the start, at 0
	}
	for _, a := range []string{"deleted", "archived", "archive_conflicts", "inbox_deleted"} {
		m.rows.WithLabelValues(a)
	}
	return m, nil
}

// RetentionRun counts one run.
func (m *Metrics) RetentionRun(res retention.Result, err error) {
	switch {
	case err != nil:
		m.runs.WithLabelValues("failed").Inc()
	case res.Skipped:
		m.runs.WithLabelValues("skipped").Inc()
	default:
		m.runs.WithLabelValues("done").Inc()
		m.lastDone.Set(float64(time.Now().UnixNano()) / 1e9)
	}
	m.rows.WithLabelValues("deleted").Add(float64(res.Deleted))
	m.rows.WithLabelValues("archived").Add(float64(res.Archived))
	m.rows.WithLabelValues("archive_conflicts").Add(float64(res.ArchiveConflicts))
	m.rows.WithLabelValues("inbox_deleted").Add(float64(res.InboxDeleted))
}
