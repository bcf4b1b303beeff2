package forwarder_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/forwarder/prommetrics"
)

// promMetrics is the Prometheus forwarder.Metrics on reg with the defaults.
func promMetrics(t *testing.T, reg prometheus.Registerer) forwarder.Metrics {
	t.Helper()
	m, err := prommetrics.New(reg, prommetrics.Options{})
	require.NoError(t, err)
	return m
}

// 300 destinations through a real forwarder pass: the destination label
// takes at most MaxDestinations values plus "_other", and every row is still
// counted.
func TestMetricsDestinationsAreBounded(t *testing.T) {
	s := newDB(t)
	const dests, maxDests = 300, 20
	for i := range dests {
		insertN(t, s.DB, fmt.Sprintf("topic.%03d", i), fmt.Sprintf("m%03d", i))
	}
	reg := prometheus.NewPedanticRegistry()
	m, err := prommetrics.New(reg, prommetrics.Options{
		MaxDestinations: maxDests, Namespace: "shop", ConstLabels: prometheus.Labels{"relay": "eu-1"},
	})
	require.NoError(t, err)
	f := newForwarder(t, s.DB, &recorder{}, forwarder.Config{Metrics: m, BatchSize: 1000})
	rep, err := f.RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, dests, rep.Published)

	mfs, err := reg.Gather()
	require.NoError(t, err)
	byName := map[string]int{}
	var total, other float64
	for _, mf := range mfs {
		byName[mf.GetName()] = len(mf.GetMetric())
		for _, mt := range mf.GetMetric() {
			labels := map[string]string{}
			for _, l := range mt.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			require.Equal(t, "eu-1", labels["relay"], "the const label is on every series of %s", mf.GetName())
			if mf.GetName() == "shop_forwarder_messages_total" {
				total += mt.GetCounter().GetValue()
				if labels["destination"] == prommetrics.OtherDestination {
					other = mt.GetCounter().GetValue()
				}
			}
		}
	}
	require.Equal(t, maxDests+1, byName["shop_forwarder_messages_total"], "20 destinations and _other, not 300")
	require.Equal(t, maxDests+1, byName["shop_forwarder_publish_duration_seconds"])
	require.Equal(t, float64(dests), total, "every row is counted")
	require.Equal(t, float64(dests-maxDests), other, "the rows beyond the cap are counted under _other")
	require.Zero(t, byName[forwarder.MetricMessages], "the namespace replaces outbox_")
	problems, err := testutil.GatherAndLint(reg)
	require.NoError(t, err)
	require.Empty(t, problems)
}

func TestPromMetricsRefusesBadOptions(t *testing.T) {
	_, err := prommetrics.New(nil, prommetrics.Options{})
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
	_, err = prommetrics.New(prometheus.NewRegistry(), prommetrics.Options{MaxDestinations: -1})
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
	_, err = prommetrics.New(prometheus.NewRegistry(), prommetrics.Options{BatchSize: -1})
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
	// A collector of another type under one of the names cannot be shared.
	reg := prometheus.NewRegistry()
	reg.MustRegister(prometheus.NewGauge(prometheus.GaugeOpts{Name: forwarder.MetricPasses, Help: "x"}))
	_, err = prommetrics.New(reg, prommetrics.Options{})
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)

	// Names are refused before any collector is built: a constant "le"
	// made prometheus.NewHistogram panic.
	for name, tc := range map[string]struct {
		o    prommetrics.Options
		hint string
	}{
		"le":              {prommetrics.Options{ConstLabels: prometheus.Labels{"le": "x"}}, `"le" is a label the forwarder's collectors set`},
		"destination":     {prommetrics.Options{ConstLabels: prometheus.Labels{"destination": "x"}}, `"destination" is a label`},
		"outcome":         {prommetrics.Options{ConstLabels: prometheus.Labels{"outcome": "x"}}, `"outcome" is a label`},
		"label dash":      {prommetrics.Options{ConstLabels: prometheus.Labels{"a-b": "x"}}, `"a-b" is not a Prometheus label name`},
		"label reserved":  {prommetrics.Options{ConstLabels: prometheus.Labels{"__x": "x"}}, `"__x" is not a Prometheus label name`},
		"label empty":     {prommetrics.Options{ConstLabels: prometheus.Labels{"": "x"}}, `"" is not a Prometheus label name`},
		"namespace dash":  {prommetrics.Options{Namespace: "a-b"}, `Namespace "a-b"`},
		"namespace digit": {prommetrics.Options{Namespace: "1a"}, `Namespace "1a"`},
		"namespace space": {prommetrics.Options{Namespace: "a b"}, `Namespace "a b"`},
	} {
		reg := prometheus.NewPedanticRegistry()
		require.NotPanics(t, func() { _, err = prommetrics.New(reg, tc.o) }, name)
		require.Error(t, err, name)
		require.Equal(t, outbox.CodeInvalidConfig, outbox.CodeOf(err), name)
		require.Contains(t, err.Error(), tc.hint, name)
		mfs, gerr := reg.Gather()
		require.NoError(t, gerr, name)
		require.Empty(t, mfs, "%s: nothing registered", name)
	}
	_, err = prommetrics.New(prometheus.NewRegistry(), prommetrics.Options{Namespace: "_shop_2", ConstLabels: prometheus.Labels{"shard_1": "a-b", "_x": ""}})
	require.NoError(t, err, "classic names pass")
}
