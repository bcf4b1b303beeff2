package main

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/internal/testdb"
)

// tinyConfig runs every scenario once, small enough for `make test`.
func tinyConfig(t *testing.T) Config {
	cfg := defaultConfig()
	cfg.URL = testdb.URL()
	cfg.Out = filepath.Join(t.TempDir(), "results.json")
	cfg.Reps = 1
	cfg.Writers = []int{1, 2}
	cfg.PerTx = []int{1, 3}
	cfg.WriteDuration = 100 * time.Millisecond
	cfg.Backlog = 300
	cfg.LatencyRate = 50
	cfg.LatencyDur = 200 * time.Millisecond
	cfg.IdleDur = 200 * time.Millisecond
	cfg.ScaleBacklogs = []int{200, 400}
	cfg.ScaleWatermill = 400
	cfg.RetentionRows = 1500
	cfg.Probes = 2
	cfg.DrainTimeout = 30 * time.Second
	cfg.Quiet = true
	cfg.WhatIf = true
	return cfg
}

// TestSmoke runs the whole program in a tiny configuration and checks the
// result file names every scenario with a non-zero measurement. It asserts
// no timing: the machine is shared, the full run is `make bench`.
func TestSmoke(t *testing.T) {
	cfg := tinyConfig(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	_, err := run(ctx, cfg, nil)
	require.NoError(t, err)

	b, err := os.ReadFile(cfg.Out)
	require.NoError(t, err)
	var rep Report
	require.NoError(t, json.Unmarshal(b, &rep))

	got := map[string]Result{}
	for _, r := range rep.Results {
		got[r.Name] = r
	}
	var want []string
	for _, w := range cfg.Writers {
		for _, n := range cfg.PerTx {
			for _, impl := range writeImpls {
				want = append(want, writeName(impl, w, n))
			}
		}
	}
	for _, d := range cfg.drainKinds() {
		want = append(want, drainName(d.kind, d.relays))
	}
	for _, k := range latencyKinds {
		want = append(want, latencyName(k, "p50"), latencyName(k, "p99"), idleName(k))
	}
	for _, n := range cfg.ScaleBacklogs {
		want = append(want, scaleName("outbox", n), scaleName("claim-p50", n), scaleName("claim-p99", n),
			scaleName("wal-bytes-per-row", n), scaleName("wal-fpi-per-row", n), scaleName("checkpoints", n),
			scaleName("backend-writes-per-row", n))
	}
	want = append(want, scaleName(relayWMTuned, cfg.ScaleWatermill), scaleName(relayOursTuned, cfg.ScaleWatermill),
		"retention/claim-p50/idle", "retention/claim-p99/idle",
		"retention/claim-p50/during", "retention/claim-p99/during", "retention/deleted-per-s")
	for _, name := range want {
		r, ok := got[name]
		require.True(t, ok, "result %s missing from %s", name, cfg.Out)
		require.Len(t, r.Samples, cfg.Reps, name)
		switch r.Group {
		case "latency":
			// A message can arrive before Commit returns (NOTIFY), so a
			// latency may be zero; it is never negative.
			require.GreaterOrEqual(t, r.Median, 0.0, name)
		case "server":
			// Server counters: a tiny drain causes no checkpoint and no
			// full-page image; WAL it always writes.
			require.GreaterOrEqual(t, r.Median, 0.0, name)
			if strings.HasPrefix(name, "scale/wal-bytes-per-row/") {
				require.Greater(t, r.Median, 0.0, name)
			}
		default:
			require.Greater(t, r.Median, 0.0, "%s has no measurement", name)
		}
	}
	require.Len(t, rep.Results, len(want), "unexpected extra results")
	require.NotEmpty(t, rep.Targets)
	require.Contains(t, rep.ExplainClaim, "messaging_outbox_unkeyed_claimable_idx", "the claim's unkeyed half must be an index scan on the unkeyed claimable index")
	require.NotEmpty(t, rep.Machine.PostgreSQL)
	require.Len(t, rep.WAL, 6, "WAL per row of the six statements")

	md, err := os.ReadFile(filepath.Join(filepath.Dir(cfg.Out), "results.md"))
	require.NoError(t, err)
	for _, name := range want {
		require.Contains(t, string(md), "| "+name+" |")
	}
}

// TestIntsRefusesBadLists covers the flag parser's refusals.
func TestIntsRefusesBadLists(t *testing.T) {
	got, err := ints("1, 4,16,")
	require.NoError(t, err)
	require.Equal(t, []int{1, 4, 16}, got)
	for _, bad := range []string{"x", "0", "-3", "1,two"} {
		_, err := ints(bad)
		require.Error(t, err, bad)
	}
}

// TestRunRefusesZeroReps: a run needs at least one repetition.
func TestRunRefusesZeroReps(t *testing.T) {
	cfg := tinyConfig(t)
	cfg.Reps = 0
	_, err := run(context.Background(), cfg, nil)
	require.ErrorContains(t, err, "-reps")
}

// TestPairRatio: target ratios pair the samples of one repetition, so a
// repetition where the whole machine was slow does not skew them.
func TestPairRatio(t *testing.T) {
	c := newCollector()
	for _, v := range [][2]float64{{100, 50}, {10, 10}, {300, 100}} {
		c.add("g", "a", "msg/s", v[0])
		c.add("g", "b", "msg/s", v[1])
	}
	// Per repetition 2, 1, 3: median 2. The ratio of the medians would be
	// 100/50 = 2 as well here; what matters is that pairs stay paired.
	require.Equal(t, 2.0, c.pairRatio("a", "b"))
	require.Equal(t, 0.0, c.pairRatio("a", "missing"))
	require.Equal(t, 0.0, ratio(1, 0))
	r := c.results()
	require.Len(t, r, 2)
	require.Equal(t, 100.0, r[0].Median)
	require.InDelta(t, (300.0-10)/100, r[0].Spread, 1e-9)
}

func TestPercentile(t *testing.T) {
	d := []time.Duration{5 * time.Millisecond, time.Millisecond, 3 * time.Millisecond, 2 * time.Millisecond, 4 * time.Millisecond}
	require.Equal(t, 3.0, percentileMS(d, 50))
	require.Equal(t, 5.0, percentileMS(d, 99))
	require.Equal(t, 0.0, percentileMS(nil, 99))
}

// -drain keeps only the named drain cells, in the scenario's order, for
// paired A/B runs of two relay variants.
func TestDrainFilter(t *testing.T) {
	cfg := defaultConfig()
	require.Equal(t, drainKinds, cfg.drainKinds())
	cfg.Drain = []string{"outbox-noprefetch/x1", "outbox/x1", "nonsense/x9"}
	require.Equal(t, []drainKind{{relayOurs, 1}, {relayOursNoPF, 1}}, cfg.drainKinds())
}

// -db-latency-ms: the proxied URL reaches the same server (a drain cell runs
// through it) and a URL without a host is refused before anything starts.
func TestLatencyProxy(t *testing.T) {
	_, _, err := viaLatencyProxy("host=127.0.0.1 user=postgres", 1)
	require.ErrorContains(t, err, "needs the database as a URL with a host")

	proxied, stop, err := viaLatencyProxy(testdb.URL(), 1)
	require.NoError(t, err)
	defer stop()
	require.NotEqual(t, testdb.URL(), proxied)
	cfg := tinyConfig(t)
	cfg.URL = proxied
	cfg.Only = []string{"drain"}
	cfg.Drain = []string{"outbox/x1"}
	cfg.DBLatencyMs = 1
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	rep, err := run(ctx, cfg, nil)
	require.NoError(t, err)
	require.Len(t, rep.Results, 1)
	require.Equal(t, "drain/outbox/x1", rep.Results[0].Name)
	require.Positive(t, rep.Results[0].Median)
}
