package prommetrics_test

import (
	"context"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/retention"
	"github.com/fencedoutbox/watermill-outbox/retention/prommetrics"
)

// value is the value of the series name{label=value} in reg.
func value(t *testing.T, reg *prometheus.Registry, name, label, want string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == label && l.GetValue() == want {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	t.Fatalf("no series %s{%s=%q}", name, label, want)
	return 0
}

// A run that did its work and a run skipped because another session holds
// the retention lock are told apart, so a lock squatter that stops
// retention shows on a dashboard (issue 21: a skipped run must be visible).
func TestRunsAreCountedByResult(t *testing.T) {
	ctx := context.Background()
	s := testdb.New(t)
	old := func(id string) testdb.OutboxRow {
		return testdb.Row(envelope.Row{MessageID: id, Destination: "d", Payload: []byte("x"), Status: envelope.StatusPublished},
			testdb.SQL("published_at", "now() - interval '100 hours'"))
	}
	testdb.InsertRows(t, s.DB, old("old-1"), old("old-2"), old("old-3"))
	reg := prometheus.NewRegistry()
	m, err := prommetrics.New(reg, prommetrics.Options{})
	require.NoError(t, err)
	c, err := retention.New(s.DB, nil, retention.Config{Metrics: m})
	require.NoError(t, err)

	res, err := c.Run(ctx)
	require.NoError(t, err)
	require.Equal(t, 3, res.Deleted)
	require.Equal(t, 1.0, value(t, reg, "outbox_retention_runs_total", "result", "done"))
	require.Equal(t, 3.0, value(t, reg, "outbox_retention_rows_total", "action", "deleted"))

	squatter, err := s.DB.Conn(ctx)
	require.NoError(t, err)
	defer squatter.Close()
	_, err = squatter.ExecContext(ctx,
		`SELECT pg_advisory_lock(hashtextextended('watermill-outbox/retention/' || 'messaging_outbox'::regclass::oid::text, 0))`)
	require.NoError(t, err)
	res, err = c.Run(ctx)
	require.NoError(t, err)
	require.True(t, res.Skipped)
	require.Equal(t, 1.0, value(t, reg, "outbox_retention_runs_total", "result", "skipped"))
	require.Equal(t, 1.0, value(t, reg, "outbox_retention_runs_total", "result", "done"), "unchanged")
	require.Equal(t, 0.0, value(t, reg, "outbox_retention_runs_total", "result", "failed"))

	_, err = prommetrics.New(nil, prommetrics.Options{})
	require.Error(t, err, "a nil registerer is refused")
	_, err = prommetrics.New(reg, prommetrics.Options{})
	require.Error(t, err, "registering twice is refused, not a panic")
}
