package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"encoding/xml"
	"fmt"
	"io"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// tinyConfig runs every scenario once, small enough for `make test`.
func tinyConfig(t *testing.T) Config {
	cfg := defaultConfig()
	cfg.URL = testdb.URL()
	cfg.Out = filepath.Join(t.TempDir(), "results.json")
	cfg.Reps = 1
	cfg.Writers = []int{2}
	cfg.PerTx = []int{3}
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
	cfg.Keys = []int{1, 10}
	cfg.ParkedBehind, cfg.ClaimKeys, cfg.ClaimPerKey, cfg.ClaimProbes = 100, 5, 20, 3
	cfg.SteadyRate, cfg.SteadyKeys, cfg.SteadyWriters = 100, 5, 2
	cfg.RecoveryBacklog, cfg.Outage = cfg.Backlog, time.Second
	cfg.WriteKeys = 3
	cfg.LaneClaimRows, cfg.LaneClaimBatch, cfg.LaneClaimWarm = 400, 50, 0
	cfg.SustainedRows, cfg.SustainedRounds = 200, 2
	return cfg
}

// TestSmoke runs the whole program in a tiny configuration and checks the
// result file names every scenario with a non-zero measurement. It asserts
// no timing: the machine is shared, the full run is `make bench`.
//
// The program runs in three parts at once (a tiny run mostly waits for the
// database; go test would run at most GOMAXPROCS parallel tests, so the
// parts are goroutines, not parallel tests): every drain cell; the write
// side, latency, idle load, scale and retention; the rest (recovery, claim
// cost, steady load, beside the two drain cells they read). Each part
// expects exactly the results of its groups, so together they cover the
// whole program.
func TestSmoke(t *testing.T) {
	parts := map[string]Config{}
	drains := tinyConfig(t)
	drains.Only = []string{"drain"}
	parts["drain"] = drains
	writes := tinyConfig(t)
	writes.Only = []string{"write", "latency", "idle", "scale", "retention"}
	parts["write-latency-scale"] = writes
	rest := tinyConfig(t)
	rest.Only = []string{"drain", "recovery", "claimcost", "steady"}
	rest.Drain = []string{"outbox/x1", "watermill-tuned/x1"}
	parts["rest"] = rest
	sustained := tinyConfig(t)
	sustained.Only = []string{"sustained"}
	parts["sustained"] = sustained
	for name := range parts {
		cfg := parts[name]
		cfg.Out = filepath.Join(t.TempDir(), "results.json")
		parts[name] = cfg
	}

	// Bounded by the test's own deadline (go test -timeout), less a minute
	// to report: a fixed 3 minutes was overrun by the drain part on the
	// loaded CI machine (3m1s), which cancelled a schema's migration midway.
	ctx, cancel := context.WithCancel(context.Background())
	if deadline, ok := t.Deadline(); ok {
		ctx, cancel = context.WithDeadline(context.Background(), deadline.Add(-time.Minute))
	}
	defer cancel()
	errs := make(map[string]error, len(parts))
	var mu sync.Mutex
	var wg sync.WaitGroup
	for name, cfg := range parts {
		wg.Go(func() {
			start := time.Now()
			_, err := run(ctx, cfg, nil)
			t.Logf("part %s: %s", name, time.Since(start).Round(time.Second))
			mu.Lock()
			errs[name] = err
			mu.Unlock()
		})
	}
	wg.Wait()
	for name, err := range errs {
		require.NoError(t, err, name)
	}

	t.Run("drain", func(t *testing.T) {
		rep, md := smokeCheck(t, parts["drain"])
		requireTargets(t, rep, "drain keyed: 10 keys / unkeyed", "drain keyed: 1 key (total order) / watermill tuned")
		require.Contains(t, md, "Relay CPU per relayed message")
		require.Contains(t, md, "| "+drainKind{relayOurs, 1, 10}.name()+" |")
		// One row version per relayed message on lanes (the outcome), two
		// with per-row leases (the lease, then the outcome), from the
		// server's own counts.
		versions := map[string]float64{}
		for _, r := range rep.Results {
			versions[r.Name] = r.Median
		}
		for _, d := range []drainKind{{relayOursLanes, 1, 0}, {relayOursLanes, 4, 0}, {relayOursLanes, 4, 100}} {
			require.Equal(t, 1.0, versions[versionsName(d.name())], d.name())
		}
		require.Equal(t, 2.0, versions[versionsName(drainKind{relayOurs, 1, 0}.name())])
		requireTargets(t, rep, "WAL per relayed message: outbox-lanes x1 / minimal relay (best batch)",
			"WAL per relayed message: outbox-lanes x4 / minimal relay (best batch)",
			"row versions per relayed message: outbox-lanes x1", "row versions per relayed message: outbox-lanes x4")
	})
	t.Run("write-latency-scale", func(t *testing.T) {
		rep, _ := smokeCheck(t, parts["write-latency-scale"])
		requireTargets(t, rep, "write w2 b3: LockOrderingKeys / without, keyed")
		require.Contains(t, rep.ExplainClaim, "messaging_outbox_unkeyed_claimable_idx", "the claim's unkeyed half must be an index scan on the unkeyed claimable index")
		require.Len(t, rep.WAL, 6, "WAL per row of the six statements")
	})
	t.Run("rest", func(t *testing.T) {
		rep, md := smokeCheck(t, parts["rest"])
		require.Contains(t, rep.ExplainParkedHead, "messaging_outbox_ordering_head_idx", "the parked-head claim walks the keys on the ordering index")
		requireTargets(t, rep, "claim p99: clean / 100 rows behind a parked head", "steady load p99: watermill tuned / outbox",
			"recovery after a 1s outage: allowed / outbox")
		require.Contains(t, md, "Recovery after a 1s downstream outage")
		require.Contains(t, md, "rows behind a parked head")
		got := map[string]float64{}
		for _, r := range rep.Results {
			got[r.Name] = r.Median
		}
		require.Zero(t, got[recoveryName(relayOurs, "undelivered")], "every message arrives after the outage")
		require.Zero(t, got[recoveryName(relayWMTuned, "undelivered")], "every message arrives after the outage")
		require.Positive(t, got[recoveryName(relayOurs, "refused-publishes")], "the outage refused publishes")
		require.InDelta(t, got[drainName(relayOurs, 1)]/2, got[steadyName(relayOurs, "offered")], 1, "the steady load is half the drain rate")
		requireTargets(t, rep, "claim per row, lanes: 4 relays / 1 relay")
	})
	t.Run("sustained", func(t *testing.T) {
		rep, _ := smokeCheck(t, parts["sustained"])
		requireTargets(t, rep, "sustained: outbox nosnapshot, round 2 / round 1", "sustained: outbox-lanes snapshot, round 2 / round 1",
			"sustained: skiplocked-tuned snapshot, round 2 / round 1")
		i := slices.IndexFunc(rep.Targets, func(tg Target) bool { return strings.HasPrefix(tg.Name, "sustained:") })
		require.Contains(t, rep.Targets[i].Note, "server autovacuum = ")
	})
}

// expectedResults are the result names a run of cfg must produce.
func expectedResults(cfg Config) []string {
	var want []string
	for _, w := range cfg.Writers {
		for _, n := range cfg.PerTx {
			for _, impl := range append(slices.Clone(writeImpls), keyedWriteImpls()...) {
				if cfg.runs("write") {
					want = append(want, writeName(impl, w, n))
				}
			}
		}
	}
	for _, d := range cfg.drainKinds() {
		if cfg.runs("drain") {
			want = append(want, d.name(), drainCPUName(d.name()), drainCPUName(d.name())+"/server")
			if d.kind != relayWMDefault && d.kind != relayWMTuned {
				want = append(want, versionsName(d.name()), versionsName(d.name())+"/hot", walName(d.name()), walName(d.name())+"/own", walName(d.name())+"/own/records")
			}
		}
	}
	for _, k := range recoveryKinds {
		for _, what := range []string{"undisturbed-drain", "after-outage", "undelivered", "refused-publishes"} {
			if cfg.runs("recovery") {
				want = append(want, recoveryName(k, what))
			}
		}
	}
	if cfg.runs("recovery") {
		want = append(want, recoveryName(relayOurs, "allowed"), recoveryName(relayOurs, "exhausted"), recoveryName(relayOurs, "max-attempts"))
	}
	for _, cs := range claimCostCases(cfg) {
		if cfg.runs("claimcost") {
			want = append(want, claimCostName(cs, "p50"), claimCostName(cs, "p99"))
		}
	}
	for _, lc := range laneClaimCases(1) {
		if cfg.runs("claimcost") {
			want = append(want, lc.name(), lc.name()+"/cpu", lc.name()+"/cold", lc.name()+"/cold/cpu")
		}
	}
	for _, mode := range []string{modeNoSnapshot, modeSnapshot} {
		for _, k := range sustainedKinds {
			if cfg.runs("sustained") {
				want = append(want, sustainedName(k, mode, 1), sustainedName(k, mode, cfg.SustainedRounds))
			}
		}
	}
	for _, k := range latencyKinds {
		if cfg.runs("latency") {
			want = append(want, latencyName(k, "p50"), latencyName(k, "p99"))
		}
	}
	for _, k := range steadyKinds {
		for _, what := range []string{"p50", "p99", "offered", "committed", "late"} {
			if cfg.runs("steady") {
				want = append(want, steadyName(k, what))
			}
		}
	}
	for _, k := range idleKinds {
		if cfg.runs("idle") {
			want = append(want, idleName(k))
		}
	}
	for _, n := range cfg.ScaleBacklogs {
		if cfg.runs("scale") {
			want = append(want, scaleName("outbox", n), scaleName("claim-p50", n), scaleName("claim-p99", n),
				scaleName("wal-bytes-per-row", n), scaleName("wal-fpi-per-row", n), scaleName("checkpoints", n),
				scaleName("backend-writes-per-row", n))
		}
	}
	if cfg.runs("scale") {
		want = append(want, scaleName(relayWMTuned, cfg.ScaleWatermill), scaleName(relayOursTuned, cfg.ScaleWatermill))
	}
	if cfg.runs("retention") {
		want = append(want, "retention/claim-p50/idle", "retention/claim-p99/idle",
			"retention/claim-p50/during", "retention/claim-p99/during", "retention/deleted-per-s")
	}
	return want
}

// smokeCheck checks that the result file and markdown of a run of cfg hold
// exactly the expected results, each measured; it returns the report and
// the markdown.
func smokeCheck(t *testing.T, cfg Config) (Report, string) {
	t.Helper()
	b, err := os.ReadFile(cfg.Out)
	require.NoError(t, err)
	var rep Report
	require.NoError(t, json.Unmarshal(b, &rep))

	got := map[string]Result{}
	for _, r := range rep.Results {
		got[r.Name] = r
	}
	want := expectedResults(cfg)
	for _, name := range want {
		r, ok := got[name]
		require.True(t, ok, "result %s missing from %s", name, cfg.Out)
		require.Len(t, r.Samples, cfg.Reps, name)
		switch {
		case r.Group == "latency" || r.Group == "steady" && (strings.HasSuffix(name, "/p50") || strings.HasSuffix(name, "/p99")):
			// A message can arrive before Commit returns (NOTIFY), so a
			// latency may be zero; it is never negative.
			require.GreaterOrEqual(t, r.Median, 0.0, name)
		case r.Group == "server":
			// Server counters: a tiny drain causes no checkpoint and no
			// full-page image; WAL it always writes.
			require.GreaterOrEqual(t, r.Median, 0.0, name)
			if strings.HasPrefix(name, "scale/wal-bytes-per-row/") {
				require.Greater(t, r.Median, 0.0, name)
			}
		case r.Group == "recovery" || strings.HasSuffix(name, "/late") || r.Group == "versions" && strings.HasSuffix(name, "/hot") ||
			r.Group == "wal" && (strings.HasSuffix(name, "/own") || strings.HasSuffix(name, "/own/records")) || strings.HasPrefix(name, "claimcost/lanes/") && strings.HasSuffix(name, "/cpu") ||
			r.Group == "cpu" && strings.HasSuffix(name, "/server"):
			// This database's WAL is 0 where pg_walinspect is missing, the
			// backends' and the server's CPU where the server is on another
			// machine (and the server's, read in 10 ms ticks, on a tiny
			// drain).
			// HOT versions: none on lanes and for the minimal relay.
			// Counts that are zero when all goes well; times that are
			// short on a tiny backlog.
			require.GreaterOrEqual(t, r.Median, 0.0, name)
		default:
			require.Greater(t, r.Median, 0.0, "%s has no measurement", name)
		}
	}
	require.Len(t, rep.Results, len(want), "unexpected extra results")
	require.NotEmpty(t, rep.Targets)
	require.NotEmpty(t, rep.Machine.PostgreSQL)

	md, err := os.ReadFile(filepath.Join(filepath.Dir(cfg.Out), "results.md"))
	require.NoError(t, err)
	for _, name := range want {
		require.Contains(t, string(md), "| "+name+" |")
	}
	return rep, string(md)
}

// requireTargets: each target named by a prefix is present, measured (a
// ratio) and says what it compares.
func requireTargets(t *testing.T, rep Report, prefixes ...string) {
	t.Helper()
	for _, prefix := range prefixes {
		i := slices.IndexFunc(rep.Targets, func(tg Target) bool { return strings.HasPrefix(tg.Name, prefix) })
		require.GreaterOrEqual(t, i, 0, "target %q missing", prefix)
		require.Positive(t, rep.Targets[i].Ratio, prefix)
		require.NotEmpty(t, rep.Targets[i].Note, prefix)
		require.NotContains(t, rep.Targets[i].Note, "not measured", prefix)
	}
}

// backlogMsg is the backlog's message g ("ob-<g>"), with ordering key key
// unless it is "".
func backlogMsg(g int, key string) *message.Message {
	m := message.NewMessage(fmt.Sprintf("ob-%d", g), nil)
	if key != "" {
		envelope.SetOrderingKey(m, key)
	}
	return m
}

// The order check judges first deliveries at Publish: a key's messages must
// come in seq order (g increasing), a redelivery is not judged, and a
// message without its key or from outside the backlog is a failure.
func TestOrderCheck(t *testing.T) {
	pub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	defer pub.Close()
	oc := newOrderCheck(pub, "ob-", 10)
	require.NoError(t, oc.Publish("t", backlogMsg(1, "k1"), backlogMsg(2, "k0"), backlogMsg(3, "k1")))
	require.NoError(t, oc.Publish("t", backlogMsg(1, "k1"))) // a redelivery
	require.NoError(t, oc.Publish("t", backlogMsg(4, "k0")))
	require.NoError(t, oc.violation())
	require.Equal(t, 4, oc.firstDeliveries())
	require.NoError(t, oc.Publish("t", backlogMsg(6, "k1"), backlogMsg(5, "k1")))
	require.ErrorContains(t, oc.violation(), "key k1: ob-5 published after ob-6")

	for _, m := range []*message.Message{backlogMsg(7, ""), backlogMsg(11, "k1"), message.NewMessage("other", nil)} {
		oc := newOrderCheck(pub, "ob-", 10)
		require.NoError(t, oc.Publish("t", m))
		require.Error(t, oc.violation(), m.UUID)
	}
}

// On the mixed backlog (unkeyedToo) a message without a key is counted and
// not judged; the keyed ones still are.
func TestOrderCheckOnTheMixedBacklog(t *testing.T) {
	pub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	defer pub.Close()
	oc := newOrderCheck(pub, "ob-", 10)
	oc.unkeyedToo = true
	require.NoError(t, oc.Publish("t", backlogMsg(3, ""), backlogMsg(1, ""), backlogMsg(2, "hot0"), backlogMsg(3, ""), backlogMsg(4, "hot0")))
	require.NoError(t, oc.violation())
	require.Equal(t, 4, oc.firstDeliveries(), "a redelivery of an unkeyed message counted once")
	require.NoError(t, oc.Publish("t", backlogMsg(6, "hot0"), backlogMsg(5, "hot0")))
	require.ErrorContains(t, oc.violation(), "key hot0: ob-5 published after ob-6")
}

// A steady load is spread over transactions of several messages once the
// writers' transaction rate would exceed maxTxPerWriter each.
func TestLoadShape(t *testing.T) {
	perTx, every := load{rate: 200, writers: 1}.shape()
	require.Equal(t, 1, perTx)
	require.Equal(t, 5*time.Millisecond, every)
	perTx, every = load{rate: 16000, writers: 4}.shape()
	require.Equal(t, 16, perTx)
	require.Equal(t, 4*time.Millisecond, every)
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

	cfg = tinyConfig(t)
	cfg.ClaimProbes = 0
	_, err = run(context.Background(), cfg, nil)
	require.ErrorContains(t, err, "-claim-probes")
	cfg = tinyConfig(t)
	cfg.Outage = -time.Second
	_, err = run(context.Background(), cfg, nil)
	require.ErrorContains(t, err, "-outage")
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
	require.Equal(t, append(slices.Clone(drainKinds), keyedKinds(cfg.Keys)...), cfg.drainKinds())
	require.Len(t, keyedKinds(cfg.Keys), 10, "1, 10, 100, 1,000 and 10,000 keys, at defaults and at batch 1000")
	cfg.Drain = []string{"outbox-noprefetch/x1", "outbox/x1", "nonsense/x9", "outbox-tuned-k100/x1"}
	require.Equal(t, []drainKind{{relayOurs, 1, 0}, {relayOursNoPF, 1, 0}, {relayOursTuned, 1, 100}}, cfg.drainKinds())
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
	require.Len(t, rep.Results, 8)
	require.Equal(t, "drain/outbox/x1", rep.Results[0].Name)
	require.Equal(t, "cpu/outbox/x1", rep.Results[1].Name)
	require.Equal(t, "cpu/outbox/x1/server", rep.Results[2].Name)
	require.Equal(t, "versions/outbox/x1", rep.Results[3].Name)
	require.Equal(t, 2.0, rep.Results[3].Median, "per-row leases: the lease, then the outcome")
	require.Equal(t, "wal/outbox/x1", rep.Results[5].Name)
	require.Positive(t, rep.Results[5].Median)
	require.Positive(t, rep.Results[0].Median)
}

// The issue 14/19 targets from made-up cells: each compares what its name
// says, in the direction where higher is better, and a missing cell is
// reported as not measured rather than hidden.
func TestKeyedTargets(t *testing.T) {
	cfg := defaultConfig()
	cfg.Keys = []int{1, 10}
	c := newCollector()
	for name, v := range map[string]float64{
		drainName(relayOurs, 1): 30000, drainCPUName(drainName(relayOurs, 1)): 20,
		drainKind{relayOurs, 1, 10}.name(): 12000, drainCPUName(drainKind{relayOurs, 1, 10}.name()): 45,
		drainKind{relayOurs, 1, 1}.name(): 20000, drainName(relayWMTuned, 1): 18000,
		claimCostName("parked-head", "p99"): 5, claimCostName("parked-head-clean", "p99"): 2,
		steadyName(relayOurs, "p99"): 4, steadyName(relayWMTuned, "p99"): 12,
		recoveryName(relayOurs, "allowed"): 2, recoveryName(relayOurs, "after-outage"): 30,
		recoveryName(relayOurs, "max-attempts"): 7, recoveryName(relayOurs, "exhausted"): 0,
	} {
		c.add("g", name, "u", v)
	}
	got := map[string]Target{}
	for _, tg := range targets(cfg, c) {
		got[tg.Name] = tg
	}
	k10 := got["drain keyed: 10 keys / unkeyed, defaults"]
	require.InDelta(t, 0.4, k10.Ratio, 1e-9)
	require.False(t, k10.Met)
	require.Contains(t, k10.Note, "relay CPU 45.0 vs 20.0 µs/msg")
	require.True(t, got["drain keyed: 1 key (total order) / watermill tuned"].Met)
	parked := got["claim p99: clean / 20000 rows behind a parked head"]
	require.InDelta(t, 0.4, parked.Ratio, 1e-9, "parked p99 is 2.5x the clean one")
	require.False(t, parked.Met)
	require.True(t, got["steady load p99: watermill tuned / outbox (100 keys, LISTEN)"].Met)
	rec := got["recovery after a 1m0s outage: allowed / outbox"]
	require.False(t, rec.Met)
	require.Contains(t, rec.Note, "up to 7 attempts")
	unk := got["claim p99: unkeyed / 100 keys x 500 rows"]
	require.False(t, unk.Met)
	require.Contains(t, unk.Note, "not measured")
}

// The sustained rounds are opt-in: a run without -only leaves them out, and
// naming the group runs it.
func TestSustainedOptIn(t *testing.T) {
	cfg := defaultConfig()
	require.True(t, cfg.runs("drain"))
	require.False(t, cfg.runs("sustained"), "sustained runs only when named")
	cfg.Only = []string{"drain", "sustained"}
	require.True(t, cfg.runs("sustained"))
	require.False(t, cfg.runs("write"))

	cfg = tinyConfig(t)
	cfg.SustainedRounds = 1
	_, err := run(context.Background(), cfg, nil)
	require.ErrorContains(t, err, "-sustained-rounds")
}

// A negative warm-up of the lane claim cells is refused before anything
// runs; a backlog that leaves an owner no claim after its warm-up fails the
// cell instead of timing nothing.
func TestLaneClaimWarmUpIsChecked(t *testing.T) {
	cfg := tinyConfig(t)
	cfg.LaneClaimWarm = -1
	_, err := run(context.Background(), cfg, nil)
	require.ErrorContains(t, err, "-lane-claim-warm")

	cfg = tinyConfig(t)
	cfg.Only = []string{"claimcost"}
	cfg.LaneClaimWarm = 1000
	_, err = run(context.Background(), cfg, nil)
	require.ErrorContains(t, err, "raise -lane-claim-rows")
}

// The lane scheme's targets are bounds from above: met at or below the
// bound, never met when a cell did not run; WAL is judged against the
// minimal relay's cheaper batch in the same repetition.
func TestLaneTargets(t *testing.T) {
	cfg := defaultConfig()
	c := newCollector()
	lanes1 := drainKind{relayOursLanes, 1, 0}.name()
	o := func(n string) string { return n + "/own" }
	rec := func(n string) string { return n + "/own/records" }
	m1, m2 := walName(drainName(relayMinimal, 1)), walName(drainName(relayMinimalTuned, 1))
	for _, rep := range []map[string]float64{
		{o(walName(lanes1)): 1600, o(m1): 1500, o(m2): 2000, walName(lanes1): 1600, m1: 1500, m2: 2000,
			rec(walName(lanes1)): 300, rec(m1): 320, rec(m2): 330, versionsName(lanes1): 1, laneClaimName(1): 100, laneClaimName(4): 110},
		{o(walName(lanes1)): 1400, o(m1): 1600, o(m2): 1000, walName(lanes1): 9000, m1: 1600, m2: 1000,
			versionsName(lanes1): 1, laneClaimName(1): 100, laneClaimName(4): 130},
		{o(walName(lanes1)): 1500, o(m1): 1500, o(m2): 1500, walName(lanes1): 1500, m1: 1500, m2: 1500,
			versionsName(lanes1): 1.2, laneClaimName(1): 100, laneClaimName(4): 120},
		{o(walName(lanes1)): 0, o(m1): 1500, o(m2): 0, walName(lanes1): 1500, m1: 1500, m2: 1500,
			versionsName(lanes1): 1, laneClaimName(1): 100, laneClaimName(4): 120},
	} {
		for _, name := range slices.Sorted(maps.Keys(rep)) {
			c.add("g", name, "u", rep[name])
		}
	}
	got := map[string]Target{}
	for _, tg := range targets(cfg, c) {
		got[tg.Name] = tg
	}
	wal := got["WAL per relayed message: outbox-lanes x1 / minimal relay (best batch)"]
	require.True(t, wal.AtMost)
	require.InDelta(t, 1600.0/1500, wal.Ratio, 1e-9, "this database's WAL per repetition 1.067, 1.4, 1.0 (the fourth not read): median 1.067")
	require.False(t, wal.Met)
	require.Contains(t, wal.Note, "cluster-wide pg_wal_lsn_diff: 1.03", "per repetition 1.067, 9, 1.0, 1.0")
	require.Equal(t, "≤ 1.00", wal.needText())
	records := got["WAL per relayed message without full-page images: outbox-lanes x1 / minimal relay (best batch)"]
	require.InDelta(t, 300.0/320, records.Ratio, 1e-9, "the full-page images apart, against the cheaper minimal relay")
	require.True(t, records.Met)
	require.Contains(t, records.Note, "less their full-page images")
	v := got["row versions per relayed message: outbox-lanes x1"]
	require.Equal(t, 1.0, v.Ratio)
	require.True(t, v.Met)
	claim := got["claim per row, lanes: 4 relays / 1 relay"]
	require.InDelta(t, 1.2, claim.Ratio, 1e-9, "1.1, 1.3, 1.2, 1.2")
	require.True(t, claim.Met, "1.2 is within <= 1.2")
	missing := got["row versions per relayed message: outbox-lanes x4"]
	require.False(t, missing.Met, "a cell that did not run meets nothing, though its ratio 0 is below the bound")
	require.Contains(t, missing.Note, "not measured")
	require.NotContains(t, got, "sustained: outbox nosnapshot, round 6 / round 1", "sustained targets only in a run of the group")
}

// The charts draw what ran, each as well-formed SVG: every target with a
// measured ratio (coloured met or missed, a tick at the ratio needed), no
// target whose cells did not run, and every drain cell.
func TestChartsDrawWhatRan(t *testing.T) {
	rep := &Report{Config: Config{Reps: 3},
		Targets: []Target{
			{Name: "drain: outbox x1 / minimal <relay>", Ratio: 0.82, Need: 0.9},
			{Name: "row versions & more", Ratio: 1.0, Need: 1.1, AtMost: true, Met: true},
			{Name: "not run", Ratio: 0, Need: 1},
		},
		Results: []Result{
			{Name: "drain/outbox/x1", Group: "drain", Unit: "msg/s", Median: 20000, Min: 18000, Max: 21000, Spread: 0.15},
			{Name: "cpu/outbox/x1", Group: "drain", Unit: "µs/msg", Median: 25},
			{Name: "write/publisher/w1/b1", Group: "write", Unit: "msg/s", Median: 900},
		},
	}
	charts := chartFiles(rep)
	require.Len(t, charts, 2)
	for name, svg := range charts {
		d := xml.NewDecoder(strings.NewReader(svg))
		for {
			_, err := d.Token()
			if err == io.EOF {
				break
			}
			require.NoError(t, err, "%s is well-formed XML", name)
		}
	}
	tg := charts["targets.svg"]
	require.Contains(t, tg, "drain: outbox x1 / minimal &lt;relay&gt;")
	require.Contains(t, tg, "row versions &amp; more")
	require.NotContains(t, tg, "not run")
	require.Contains(t, tg, "0.82 (need 0.90 missed)")
	require.Contains(t, tg, "1.00 (need ≤ 1.10 met)")
	require.Contains(t, tg, `fill="#c0413b"`, "a missed target is red")
	require.Contains(t, tg, `fill="#3a9a4a"`, "a met one green")
	dr := charts["drain.svg"]
	require.Contains(t, dr, "drain/outbox/x1")
	require.Contains(t, dr, "20000 msg/s (15% spread)")
	require.NotContains(t, dr, "cpu/outbox/x1")
	require.NotContains(t, dr, "write/publisher")

	dir := t.TempDir()
	require.NoError(t, writeCharts(dir, rep))
	got, err := os.ReadFile(filepath.Join(dir, "targets.svg"))
	require.NoError(t, err)
	require.Equal(t, tg, string(got))
	require.Empty(t, chartFiles(&Report{}), "nothing ran: no chart")
}

// Issue 30's drain targets compare with the minimal relay's faster batch in
// each repetition, and its CPU with the lower of the two.
func TestLaneDrainTargets(t *testing.T) {
	c := newCollector()
	ours, lanes := drainName(relayOurs, 1), drainName(relayOursLanes, 1)
	m1, m2 := drainName(relayMinimal, 1), drainName(relayMinimalTuned, 1)
	for _, rep := range []map[string]float64{
		{ours: 27000, lanes: 24000, m1: 23000, m2: 38000, drainCPUName(lanes): 27, drainCPUName(m1): 23, drainCPUName(m2): 15,
			drainName(relayOursLanes, 4): 25000},
		{ours: 30000, lanes: 30000, m1: 40000, m2: 30000, drainCPUName(lanes): 30, drainCPUName(m1): 20, drainCPUName(m2): 25,
			drainName(relayOursLanes, 4): 27000},
		{ours: 20000, lanes: 20000, m1: 20000, m2: 10000, drainCPUName(lanes): 20, drainCPUName(m1): 20, drainCPUName(m2): 30,
			drainName(relayOursLanes, 4): 22000},
	} {
		for _, name := range slices.Sorted(maps.Keys(rep)) {
			c.add("drain", name, "u", rep[name])
		}
	}
	got := map[string]Target{}
	for _, tg := range targets(defaultConfig(), c) {
		got[tg.Name] = tg
	}
	d := got["drain: outbox-lanes x1 / minimal relay (best batch)"]
	require.InDelta(t, 0.75, d.Ratio, 1e-9, "per repetition 24/38, 30/40, 20/20: median 0.75")
	require.False(t, d.Met)
	require.InDelta(t, 0.75, got["drain: outbox x1 / minimal relay (best batch)"].Ratio, 1e-9, "27/38, 30/40, 1.0: median 0.75")
	cpu := got["relay CPU per message: outbox-lanes x1 / minimal relay (lower of batch 100 and 1000)"]
	require.True(t, cpu.AtMost)
	require.InDelta(t, 1.5, cpu.Ratio, 1e-9, "27/15=1.8, 30/20=1.5, 20/20=1.0: median 1.5")
	require.True(t, cpu.Met)
	x4 := got["drain: outbox-lanes x4 / outbox-lanes x1"]
	require.InDelta(t, 25.0/24, x4.Ratio, 1e-9, "25/24, 0.9, 1.1: median 1.04")
	require.True(t, x4.Met)
	require.Zero(t, got["drain: outbox-lanes-k100 x4 / outbox-lanes-k100 x1"].Ratio, "not run")
}

// -driver names the relays' database/sql driver: an unknown one is refused
// before anything runs, and with pgx's stdlib the drain of both our relay
// and the minimal one runs to the end, every message delivered.
func TestDriverFlag(t *testing.T) {
	cfg := tinyConfig(t)
	cfg.Driver = "mysql"
	_, err := run(context.Background(), cfg, nil)
	require.ErrorContains(t, err, `-driver "mysql"`)

	cfg = tinyConfig(t)
	cfg.Driver = "pgx"
	cfg.Only = []string{"drain"}
	cfg.Drain = []string{"outbox-lanes/x1", "skiplocked/x1"}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	rep, err := run(ctx, cfg, nil)
	require.NoError(t, err)
	got := map[string]float64{}
	for _, r := range rep.Results {
		got[r.Name] = r.Median
	}
	require.Positive(t, got["drain/outbox-lanes/x1"])
	require.Positive(t, got["drain/skiplocked/x1"])
	require.Equal(t, "pgx", rep.Config.Driver)
}

// The drain cells' server CPU: on this machine's server the postmaster is
// found through a backend, and work done by a backend shows in what read
// returns; a connection to nothing there (no /proc entry) reads 0.
func TestServerCPUReadsTheServerOnThisMachine(t *testing.T) {
	ctx := context.Background()
	db, err := sql.Open("postgres", testdb.URL())
	require.NoError(t, err)
	defer db.Close()
	srv := newServerCPU(ctx, db)
	require.NotZero(t, srv.postmaster, "the test server runs on this machine")
	before := srv.read()
	var n int64
	require.NoError(t, db.QueryRowContext(ctx, `SELECT count(*) FROM generate_series(1, 5000000)`).Scan(&n))
	require.Equal(t, int64(5000000), n)
	require.Greater(t, srv.read(), before, "the backend's work is counted")
	require.Zero(t, serverCPU{}.read())
}
