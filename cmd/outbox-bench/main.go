// Command outbox-bench measures this module's publisher and forwarder side
// by side with watermill's components/forwarder over watermill-sql and with
// the raw PostgreSQL limit, in one run against one server, interleaving the
// scenarios over several repetitions so a noisy shared machine moves all of
// them alike. It prints a table and writes a JSON result file; BENCHMARKS.md
// shows the latest one.
//
//	OUTBOX_TEST_DATABASE_URL=postgres://... go run ./cmd/outbox-bench -out .bench/results.json
//
// Every scenario runs in its own fresh, migrated schema inside a database
// the run creates for itself (and drops at the end), so pg_stat_database
// counts only this run's transactions. Durability stays at PostgreSQL's
// defaults (synchronous_commit on).
package main

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// Config is one run's shape; the flags fill it.
type Config struct {
	URL            string        `json:"-"`
	Out            string        `json:"out"`
	Charts         string        `json:"charts,omitempty"` // directory for the SVG charts; empty: none
	Reps           int           `json:"reps"`
	PayloadBytes   int           `json:"payload_bytes"`
	Writers        []int         `json:"writers"`
	PerTx          []int         `json:"per_tx"`
	WriteDuration  time.Duration `json:"write_duration_ns"`
	Backlog        int           `json:"backlog"`
	LatencyRate    int           `json:"latency_rate"`
	LatencyDur     time.Duration `json:"latency_duration_ns"`
	IdleDur        time.Duration `json:"idle_duration_ns"`
	ScaleBacklogs  []int         `json:"scale_backlogs"`
	ScaleWatermill int           `json:"scale_watermill_backlog"` // backlog at which watermill tuned is compared (0: skip)
	RetentionRows  int           `json:"retention_rows"`
	Probes         int           `json:"claim_probes"`
	DrainTimeout   time.Duration `json:"drain_timeout_ns"`
	// Only, when non-empty, restricts the run to these groups (write,
	// drain, latency, idle, scale, retention): for investigating one.
	Only  []string `json:"only,omitempty"`
	Quiet bool     `json:"-"`
	// WhatIf adds the prototype relay to the drain scenario.
	WhatIf bool `json:"what_if,omitempty"`
	// Drain, when non-empty, restricts the drain scenario to these cells
	// (names like outbox/x1): for paired A/B runs of two relay variants.
	Drain []string `json:"drain,omitempty"`
	// Fillfactor, when non-zero, overrides messaging_outbox's fillfactor
	// (migration 00031 sets 50) in every schema of the run: for measuring
	// the write/drain trade-off of that setting.
	Fillfactor int `json:"fillfactor,omitempty"`
	// Driver is the database/sql driver of the relays' and writers'
	// connections: "postgres" (lib/pq, the default) or "pgx".
	Driver string `json:"driver,omitempty"`
	// WALDetail prints, for every drain cell, this database's WAL records
	// grouped by relation and record type.
	WALDetail bool `json:"-"`
	// DBLatencyMs, when non-zero, sends every connection of the run through
	// a proxy that delays each reply from the database by this much.
	DBLatencyMs int `json:"db_latency_ms,omitempty"`
	// Keys are the ordering-key counts of the keyed drain cells (issue 14),
	// each drained at defaults and at BatchSize 1000 over Backlog rows.
	Keys []int `json:"keys"`
	// Claim cost under blocked keys (group "claimcost"): ParkedBehind rows
	// of one key behind its parked (EXHAUSTED) head, beside as many rows of
	// other keys; ClaimKeys keys x ClaimPerKey rows; ClaimProbes rolled-back
	// claims per case.
	ParkedBehind int `json:"parked_behind"`
	ClaimKeys    int `json:"claim_keys"`
	ClaimPerKey  int `json:"claim_per_key"`
	ClaimProbes  int `json:"claim_probes_per_case"`
	// Steady load (group "steady"): half the repetition's measured unkeyed
	// drain rate (drain/outbox/x1), or SteadyRate when that cell did not
	// run, over SteadyKeys ordering keys, by SteadyWriters writers, for
	// LatencyDur.
	SteadyRate    int `json:"steady_rate_fallback"`
	SteadyKeys    int `json:"steady_keys"`
	SteadyWriters int `json:"steady_writers"`
	// Recovery (group "recovery", issue 19): a RecoveryBacklog-row backlog,
	// the downstream unavailable for Outage, then up.
	RecoveryBacklog int           `json:"recovery_backlog"`
	Outage          time.Duration `json:"outage_ns"`
	// WriteKeys is the number of ordering keys of the keyed write cells.
	WriteKeys int `json:"write_keys"`
	// Lane claim cost (group "claimcost", issue 30): a LaneClaimRows-row
	// backlog drained by claims of LaneClaimBatch rows with 1 and 4 lane
	// owners (lanecost.go).
	LaneClaimRows  int `json:"lane_claim_rows"`
	LaneClaimBatch int `json:"lane_claim_batch"`
	// Sustained rounds (group "sustained", opt-in): SustainedRounds
	// fill-and-drain rounds of SustainedRows rows in one schema.
	SustainedRows   int `json:"sustained_rows"`
	SustainedRounds int `json:"sustained_rounds"`
}

func defaultConfig() Config {
	return Config{
		URL: testdb.URL(), Out: ".bench/results.json", Reps: 3, PayloadBytes: 1024,
		Writers: []int{1, 4, 16}, PerTx: []int{1, 10}, WriteDuration: 2 * time.Second,
		Backlog: 50000, LatencyRate: 200, LatencyDur: 8 * time.Second, IdleDur: 6 * time.Second,
		ScaleBacklogs: []int{10000, 100000}, ScaleWatermill: 100000, RetentionRows: 100000,
		Probes: 30, DrainTimeout: 5 * time.Minute,
		Keys: []int{1, 10, 100, 1000, 10000}, ParkedBehind: 20000, ClaimKeys: 100, ClaimPerKey: 500, ClaimProbes: 200,
		SteadyRate: 5000, SteadyKeys: 100, SteadyWriters: 4, RecoveryBacklog: 50000, Outage: 60 * time.Second, WriteKeys: 100,
		LaneClaimRows: 20000, LaneClaimBatch: forwarder.DefaultBatchSize, SustainedRows: 20000, SustainedRounds: 6,
	}
}

// Report is the JSON result file.
type Report struct {
	Started      time.Time `json:"started"`
	Finished     time.Time `json:"finished"`
	Command      string    `json:"command"`
	Machine      Machine   `json:"machine"`
	Config       Config    `json:"config"`
	Results      []Result  `json:"results"`
	Targets      []Target  `json:"targets"`
	ExplainClaim string    `json:"explain_claim"`
	// ExplainParkedHead is the claim's plan with ParkedBehind rows behind a
	// parked head (claim cost under blocked keys).
	ExplainParkedHead string    `json:"explain_claim_parked_head,omitempty"`
	WAL               []WALCost `json:"wal_per_row"`
}

// Machine describes where the numbers come from.
type Machine struct {
	NProc      int    `json:"nproc"`
	GoVersion  string `json:"go"`
	PostgreSQL string `json:"postgresql"`
	LoadBefore string `json:"load_before"`
	LoadAfter  string `json:"load_after"`
}

func main() {
	cfg := defaultConfig()
	flag.StringVar(&cfg.Driver, "driver", "postgres", "database/sql driver of every relay's and writer's connections, the minimal relay's too: postgres (lib/pq, text results) or pgx (pgx's stdlib, binary results)")
	flag.BoolVar(&cfg.WALDetail, "wal-detail", false, "drain: print each cell's own WAL by relation and record type (needs pg_walinspect)")
	flag.IntVar(&cfg.Fillfactor, "fillfactor", 0, "override messaging_outbox's fillfactor (10-100) in every schema of the run (0: the migration's)")
	flag.StringVar(&cfg.URL, "db", cfg.URL, "PostgreSQL URL (default: OUTBOX_TEST_DATABASE_URL or the local test server); the run creates and drops its own database there")
	flag.StringVar(&cfg.Out, "out", cfg.Out, "result file (JSON)")
	flag.StringVar(&cfg.Charts, "charts", "", "also draw the targets and drain cells as SVG charts into this directory (make bench: docs/bench)")
	flag.IntVar(&cfg.Reps, "reps", cfg.Reps, "repetitions (>= 3 for a median and a spread)")
	flag.IntVar(&cfg.PayloadBytes, "payload", cfg.PayloadBytes, "payload bytes per message")
	writers := flag.String("writers", joinInts(cfg.Writers), "write side: concurrent writers")
	perTx := flag.String("per-tx", joinInts(cfg.PerTx), "write side: messages per transaction")
	flag.DurationVar(&cfg.WriteDuration, "write-duration", cfg.WriteDuration, "write side: duration of one cell")
	flag.IntVar(&cfg.Backlog, "backlog", cfg.Backlog, "drain: pre-filled backlog rows")
	flag.IntVar(&cfg.LatencyRate, "rate", cfg.LatencyRate, "latency: messages per second")
	flag.DurationVar(&cfg.LatencyDur, "latency-duration", cfg.LatencyDur, "latency: duration of one cell")
	flag.DurationVar(&cfg.IdleDur, "idle-duration", cfg.IdleDur, "idle load: duration of one cell")
	scale := flag.String("scale", joinInts(cfg.ScaleBacklogs), "scale: backlogs (add 1000000 for the opt-in 1M case)")
	million := flag.Bool("1m", false, "scale: also run the 1,000,000-row backlog")
	flag.IntVar(&cfg.ScaleWatermill, "scale-watermill", cfg.ScaleWatermill, "scale: backlog at which watermill's tuned forwarder is compared (0: skip)")
	flag.IntVar(&cfg.RetentionRows, "retention-rows", cfg.RetentionRows, "scale: PUBLISHED rows retention deletes while the claim is probed")
	flag.IntVar(&cfg.Probes, "probes", cfg.Probes, "scale: claim probes per backlog")
	flag.BoolVar(&cfg.Quiet, "quiet", false, "no progress lines")
	flag.BoolVar(&cfg.WhatIf, "what-if", false, "drain: also run the one-commit-per-batch prototype relay (evidence for BENCHMARKS.md, not the product)")
	drain := flag.String("drain", "", "comma-separated drain cells to run (e.g. outbox/x1,outbox-noprefetch/x1); default all")
	only := flag.String("only", "", "comma-separated groups to run (write,drain,latency,steady,idle,scale,retention,claimcost,recovery,sustained); default all but sustained (opt-in: several minutes per repetition)")
	keys := flag.String("keys", joinInts(cfg.Keys), "drain: ordering-key counts of the keyed drain cells")
	flag.IntVar(&cfg.ParkedBehind, "parked-behind", cfg.ParkedBehind, "claimcost: rows behind the parked head")
	flag.IntVar(&cfg.ClaimKeys, "claim-keys", cfg.ClaimKeys, "claimcost: keys of the many-keys case")
	flag.IntVar(&cfg.ClaimPerKey, "claim-per-key", cfg.ClaimPerKey, "claimcost: rows per key of the many-keys case")
	flag.IntVar(&cfg.ClaimProbes, "claim-probes", cfg.ClaimProbes, "claimcost: rolled-back claims per case (p50, p99)")
	flag.IntVar(&cfg.SteadyRate, "steady-rate", cfg.SteadyRate, "steady: msg/s when drain/outbox/x1 did not run in the repetition (else half its rate)")
	flag.IntVar(&cfg.SteadyKeys, "steady-keys", cfg.SteadyKeys, "steady: ordering keys of our messages")
	flag.IntVar(&cfg.SteadyWriters, "steady-writers", cfg.SteadyWriters, "steady: concurrent writers")
	flag.IntVar(&cfg.RecoveryBacklog, "recovery-backlog", cfg.RecoveryBacklog, "recovery: backlog rows")
	flag.DurationVar(&cfg.Outage, "outage", cfg.Outage, "recovery: how long the downstream is unavailable")
	flag.IntVar(&cfg.WriteKeys, "write-keys", cfg.WriteKeys, "write: ordering keys of the keyed write cells")
	flag.IntVar(&cfg.LaneClaimRows, "lane-claim-rows", cfg.LaneClaimRows, "claimcost: backlog rows of the lane claim cells (claimcost/lanes/x1, x4)")
	flag.IntVar(&cfg.LaneClaimBatch, "lane-claim-batch", cfg.LaneClaimBatch, "claimcost: rows per claim of the lane claim cells")
	flag.IntVar(&cfg.SustainedRows, "sustained-rows", cfg.SustainedRows, "sustained: rows filled and drained per round")
	flag.IntVar(&cfg.SustainedRounds, "sustained-rounds", cfg.SustainedRounds, "sustained: consecutive rounds in one schema (>= 2)")
	flag.IntVar(&cfg.DBLatencyMs, "db-latency-ms", 0, "delay every reply from the database by this many milliseconds (an in-process toxiproxy): the relays as they run over a network")
	cpuprofile := flag.String("cpuprofile", "", "write a CPU profile of the whole run to this file")
	memprofile := flag.String("memprofile", "", "write an allocation profile of the whole run to this file")
	flag.Parse()
	if *only != "" {
		cfg.Only = strings.Split(*only, ",")
	}
	if *drain != "" {
		cfg.Drain = strings.Split(*drain, ",")
	}
	if *cpuprofile != "" {
		f, err := os.Create(*cpuprofile)
		if err == nil {
			err = pprof.StartCPUProfile(f)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "outbox-bench: cpuprofile:", err)
			os.Exit(2)
		}
		defer pprof.StopCPUProfile()
	}
	if *memprofile != "" {
		defer func() {
			f, err := os.Create(*memprofile)
			if err == nil {
				err = pprof.Lookup("allocs").WriteTo(f, 0)
			}
			if err != nil {
				fmt.Fprintln(os.Stderr, "outbox-bench: memprofile:", err)
			}
		}()
	}
	var err error
	if cfg.Writers, err = ints(*writers); err == nil {
		if cfg.PerTx, err = ints(*perTx); err == nil {
			if cfg.ScaleBacklogs, err = ints(*scale); err == nil {
				cfg.Keys, err = ints(*keys)
			}
		}
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "outbox-bench:", err)
		os.Exit(2)
	}
	if *million {
		cfg.ScaleBacklogs = append(cfg.ScaleBacklogs, 1000000)
	}
	if cfg.DBLatencyMs > 0 {
		var stopProxy func()
		if cfg.URL, stopProxy, err = viaLatencyProxy(cfg.URL, cfg.DBLatencyMs); err != nil {
			fmt.Fprintln(os.Stderr, "outbox-bench:", err)
			os.Exit(2)
		}
		defer stopProxy()
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	rep, err := run(ctx, cfg, os.Stderr)
	if err != nil {
		fmt.Fprintln(os.Stderr, "outbox-bench:", err)
		pprof.StopCPUProfile()
		os.Exit(1)
	}
	printTable(os.Stdout, rep)
}

// joinInts is the flag form of a list ints parses back.
func joinInts(v []int) string {
	s := make([]string, len(v))
	for i, n := range v {
		s[i] = strconv.Itoa(n)
	}
	return strings.Join(s, ",")
}

func ints(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		n, err := strconv.Atoi(f)
		if err != nil || n <= 0 {
			return nil, fmt.Errorf("%q is not a positive number", f)
		}
		out = append(out, n)
	}
	return out, nil
}

// Names of the results, shared by the run, the targets and the smoke test.
func writeName(impl string, w, b int) string { return fmt.Sprintf("write/%s/w%d/b%d", impl, w, b) }
func drainName(kind string, relays int) string {
	return fmt.Sprintf("drain/%s/x%d", kind, relays)
}

// drainCPUName is the relay process's CPU per message of a drain cell.
func drainCPUName(drain string) string { return "cpu/" + strings.TrimPrefix(drain, "drain/") }

// versionsName is a drain cell's row versions per relayed message.
func versionsName(drain string) string  { return "versions/" + strings.TrimPrefix(drain, "drain/") }
func latencyName(kind, p string) string { return fmt.Sprintf("latency/%s/%s", kind, p) }
func idleName(kind string) string       { return "idle/" + kind }
func scaleName(what string, n int) string {
	return fmt.Sprintf("scale/%s/%d", what, n)
}

// walName is a drain cell's WAL bytes per relayed message.
func walName(drain string) string {
	return "wal/" + strings.TrimPrefix(drain, "drain/")
}

// drainKinds are the drain scenario's relays (kind, relay count, and the
// ordering keys of the backlog: 0 for unkeyed rows).
type drainKind struct {
	kind   string
	relays int
	keys   int
}

// name is the cell's result name: drain/outbox/x1, drain/outbox-k10/x1.
func (d drainKind) name() string {
	if d.keys > 0 {
		return drainName(fmt.Sprintf("%s-k%d", d.kind, d.keys), d.relays)
	}
	return drainName(d.kind, d.relays)
}

// keyedKinds are the keyed drain cells: our relay at defaults and at
// BatchSize 1000 for every key count.
func keyedKinds(keys []int) []drainKind {
	var out []drainKind
	for _, k := range keys {
		out = append(out, drainKind{relayOurs, 1, k}, drainKind{relayOursTuned, 1, k})
	}
	return out
}

var drainKinds = []drainKind{{relayOurs, 1, 0}, {relayOursB100, 1, 0}, {relayOursNoPF, 1, 0}, {relayOurs, 4, 0}, {relayOursTuned, 1, 0}, {relayOursTunedNoPF, 1, 0},
	{relayWMDefault, 1, 0}, {relayWMTuned, 1, 0}, {relayMinimal, 1, 0}, {relayMinimalTuned, 1, 0},
	{relayOursLanes, 1, 0}, {relayOursLanes, 4, 0}, {relayOursLanes, 1, 100}, {relayOursLanes, 4, 100}, {relayOurs, 4, 100}}

// writeImpls are the write side's implementations, run back to back per cell.
var writeImpls = []string{implPublisher, implWatermill, implRaw, implPublisherPlain, implRawPrepared}

var latencyKinds = []string{relayOurs, relayWMDefault, relayWMTuned}

func run(ctx context.Context, cfg Config, progress io.Writer) (*Report, error) {
	if cfg.Reps < 1 {
		return nil, fmt.Errorf("-reps must be at least 1")
	}
	rep := &Report{Started: time.Now().UTC(), Config: cfg, Command: commandLine()}
	rep.Machine = Machine{NProc: runtime.NumCPU(), GoVersion: runtime.Version(), LoadBefore: loadavg()}
	for _, f := range []struct {
		flag string
		v    int
	}{{"-parked-behind", cfg.ParkedBehind}, {"-claim-keys", cfg.ClaimKeys}, {"-claim-per-key", cfg.ClaimPerKey},
		{"-claim-probes", cfg.ClaimProbes}, {"-steady-writers", cfg.SteadyWriters}, {"-steady-rate", cfg.SteadyRate},
		{"-recovery-backlog", cfg.RecoveryBacklog}, {"-write-keys", cfg.WriteKeys},
		{"-lane-claim-rows", cfg.LaneClaimRows}, {"-lane-claim-batch", cfg.LaneClaimBatch}, {"-sustained-rows", cfg.SustainedRows}} {
		if f.v < 1 {
			return nil, fmt.Errorf("%s must be at least 1, got %d", f.flag, f.v)
		}
	}
	if cfg.SustainedRounds < 2 {
		return nil, fmt.Errorf("-sustained-rounds must be at least 2, got %d", cfg.SustainedRounds)
	}
	if cfg.Outage < 0 {
		return nil, fmt.Errorf("-outage must not be negative, got %s", cfg.Outage)
	}
	if cfg.Driver != "" && cfg.Driver != "postgres" && cfg.Driver != "pgx" {
		return nil, fmt.Errorf("-driver %q: postgres or pgx", cfg.Driver)
	}
	if cfg.Fillfactor != 0 && (cfg.Fillfactor < 10 || cfg.Fillfactor > 100) {
		return nil, fmt.Errorf("-fillfactor %d: PostgreSQL accepts 10 to 100", cfg.Fillfactor)
	}
	e, err := newEnv(ctx, cfg.URL)
	if err != nil {
		return nil, err
	}
	defer e.close()
	e.fillfactor = cfg.Fillfactor
	e.walDetail = cfg.WALDetail
	e.driver = cfg.Driver
	if err := e.admin.QueryRowContext(ctx, "SHOW server_version").Scan(&rep.Machine.PostgreSQL); err != nil {
		return nil, err
	}
	var sc string
	if err := e.admin.QueryRowContext(ctx, "SHOW synchronous_commit").Scan(&sc); err != nil {
		return nil, err
	}
	if sc != "on" {
		return nil, fmt.Errorf("synchronous_commit is %q on this server; the benchmark needs PostgreSQL's default (on)", sc)
	}
	payload := make([]byte, cfg.PayloadBytes)
	_, _ = rand.Read(payload)
	logf := func(format string, args ...any) {
		if !cfg.Quiet && progress != nil {
			fmt.Fprintf(progress, "%s "+format+"\n", append([]any{time.Now().Format("15:04:05")}, args...)...)
		}
	}
	c := newCollector()
	timeout := func(n int) time.Duration { return max(cfg.DrainTimeout, time.Duration(n/200)*time.Second) }

	for r := 1; r <= cfg.Reps; r++ {
		logf("repetition %d/%d", r, cfg.Reps)
		// 1. Write side: implementations innermost, so each cell's three
		// numbers are taken back to back.
		for _, w := range cfg.Writers {
			if !cfg.runs("write") {
				break
			}
			for _, b := range cfg.PerTx {
				for _, impl := range append(slices.Clone(writeImpls), keyedWriteImpls()...) {
					v, err := writeCell(ctx, e, impl, w, b, cfg.WriteKeys, cfg.WriteDuration, payload)
					if err != nil {
						return nil, err
					}
					c.add("write", writeName(impl, w, b), "msg/s", v)
					logf("  %-28s %10.0f msg/s", writeName(impl, w, b), v)
				}
			}
		}
		// 2. Drain, unkeyed and keyed, each with the process CPU per message.
		for _, d := range cfg.drainKinds() {
			if !cfg.runs("drain") {
				break
			}
			st, err := drainCell(ctx, e, d, cfg.Backlog, payload, timeout(cfg.Backlog))
			if err != nil {
				return nil, err
			}
			c.add("drain", d.name(), "msg/s", st.rate)
			c.add("cpu", drainCPUName(d.name()), "µs/msg", st.cpuUSPerMsg)
			if d.kind != relayWMDefault && d.kind != relayWMTuned {
				c.add("versions", versionsName(d.name()), "versions/msg", st.versions)
				c.add("versions", versionsName(d.name())+"/hot", "versions/msg", st.hot)
				c.add("wal", walName(d.name()), "B/msg", st.walPerMsg)
				c.add("wal", walName(d.name())+"/own", "B/msg", st.walOwnPerMsg)
				c.add("wal", walName(d.name())+"/own/records", "B/msg", st.walOwnPerMsg-st.walOwnFPIPerMsg)
				if st.walOwnErr != nil {
					logf("  %-28s WAL of this run's database not read (recorded as 0): %v", d.name(), st.walOwnErr)
				}
			}
			logf("  %-28s %10.0f msg/s %7.1f µs CPU/msg %5.2f row versions/msg (%.2f HOT) %6.0f WAL B/msg (%.0f this database's, %.0f without full-page images)", d.name(), st.rate, st.cpuUSPerMsg, st.versions, st.hot, st.walPerMsg, st.walOwnPerMsg, st.walOwnPerMsg-st.walOwnFPIPerMsg)
		}
		// 2b. Recovery after a downstream outage, and claim cost under
		// blocked keys.
		if cfg.runs("recovery") {
			if err := runRecovery(ctx, e, cfg, c, r, payload, logf); err != nil {
				return nil, err
			}
		}
		if cfg.runs("claimcost") {
			if err := runClaimCost(ctx, e, cfg, c, rep, r == 1, payload, logf); err != nil {
				return nil, err
			}
			if err := runLaneClaimCost(ctx, e, cfg, c, r, payload, logf); err != nil {
				return nil, err
			}
		}
		if cfg.runs("sustained") {
			if err := runSustained(ctx, e, cfg, c, r, payload, timeout(cfg.SustainedRows), logf); err != nil {
				return nil, err
			}
		}
		// 3. Latency at a steady rate, and idle load.
		for _, k := range latencyKinds {
			if !cfg.runs("latency") {
				break
			}
			lr, err := latencyCell(ctx, e, k, load{rate: cfg.LatencyRate, dur: cfg.LatencyDur, writers: 1}, payload)
			if err != nil {
				return nil, err
			}
			p50, p99 := lr.p50, lr.p99
			c.add("latency", latencyName(k, "p50"), "ms", p50)
			c.add("latency", latencyName(k, "p99"), "ms", p99)
			logf("  %-28s p50 %.1f ms p99 %.1f ms", "latency/"+k, p50, p99)
		}
		if cfg.runs("steady") {
			if err := runSteady(ctx, e, cfg, c, payload, logf); err != nil {
				return nil, err
			}
		}
		for _, k := range latencyKinds {
			if !cfg.runs("idle") {
				break
			}
			v, err := idleCell(ctx, e, k, cfg.IdleDur)
			if err != nil {
				return nil, err
			}
			c.add("idle", idleName(k), "xact/s", v)
			logf("  %-28s %10.2f xact/s", idleName(k), v)
		}
		// 4. Scale.
		for i, n := range cfg.ScaleBacklogs {
			if !cfg.runs("scale") {
				break
			}
			res, err := scaleCell(ctx, e, n, payload, cfg.Probes, r == 1 && i == len(cfg.ScaleBacklogs)-1, timeout(n))
			if err != nil {
				return nil, err
			}
			if res.explain != "" {
				rep.ExplainClaim, rep.WAL = res.explain, res.wal
			}
			c.add("scale", scaleName("outbox", n), "msg/s", res.throughput)
			c.add("claim", scaleName("claim-p50", n), "ms", res.claimP50)
			c.add("claim", scaleName("claim-p99", n), "ms", res.claimP99)
			c.add("server", scaleName("wal-bytes-per-row", n), "B", res.server.WALBytes)
			c.add("server", scaleName("wal-fpi-per-row", n), "FPI", res.server.FPI)
			c.add("server", scaleName("checkpoints", n), "count", res.server.Checkpoints)
			c.add("server", scaleName("backend-writes-per-row", n), "buffers", res.server.BackendWrites)
			logf("  %-28s %10.0f msg/s claim p50 %.2f ms p99 %.2f ms; per row: WAL %.0f B, FPI %.3f, backend writes %.3f; %.0f checkpoints",
				scaleName("outbox", n), res.throughput, res.claimP50, res.claimP99,
				res.server.WALBytes, res.server.FPI, res.server.BackendWrites, res.server.Checkpoints)
		}
		if n := cfg.ScaleWatermill; n > 0 && cfg.runs("scale") {
			st, err := drainCell(ctx, e, drainKind{relayWMTuned, 1, 0}, n, payload, timeout(n))
			if err != nil {
				return nil, err
			}
			c.add("scale", scaleName(relayWMTuned, n), "msg/s", st.rate)
			logf("  %-28s %10.0f msg/s", scaleName(relayWMTuned, n), st.rate)
			// Ours with the same batch as watermill tuned, right after it.
			if st, err = drainCell(ctx, e, drainKind{relayOursTuned, 1, 0}, n, payload, timeout(n)); err != nil {
				return nil, err
			}
			c.add("scale", scaleName(relayOursTuned, n), "msg/s", st.rate)
			logf("  %-28s %10.0f msg/s", scaleName(relayOursTuned, n), st.rate)
		}
		if n := cfg.RetentionRows; n > 0 && cfg.runs("retention") {
			res, err := retentionCell(ctx, e, n, max(1000, cfg.ScaleBacklogs[0]), payload, cfg.Probes)
			if err != nil {
				return nil, err
			}
			c.add("retention", "retention/claim-p50/idle", "ms", res.claimIdleP50)
			c.add("retention", "retention/claim-p99/idle", "ms", res.claimIdleP99)
			c.add("retention", "retention/claim-p50/during", "ms", res.claimDuringP50)
			c.add("retention", "retention/claim-p99/during", "ms", res.claimDuringP99)
			c.add("retention", "retention/deleted-per-s", "msg/s", float64(res.deleted)/res.seconds)
			logf("  %-28s claim p50 %.2f→%.2f ms p99 %.2f→%.2f ms, %d deleted in %.1fs", "retention",
				res.claimIdleP50, res.claimDuringP50, res.claimIdleP99, res.claimDuringP99, res.deleted, res.seconds)
		}
	}
	rep.Results = c.results()
	rep.Targets = targets(cfg, c)
	if cfg.runs("sustained") {
		var av string
		if err := e.admin.QueryRowContext(ctx, "SHOW autovacuum").Scan(&av); err != nil {
			return nil, err
		}
		for i := range rep.Targets {
			if strings.HasPrefix(rep.Targets[i].Name, "sustained:") {
				rep.Targets[i].Note += "; server autovacuum = " + av
			}
		}
	}
	rep.Finished = time.Now().UTC()
	rep.Machine.LoadAfter = loadavg()
	if err := writeReport(cfg.Out, rep); err != nil {
		return nil, err
	}
	md := strings.TrimSuffix(cfg.Out, filepath.Ext(cfg.Out)) + ".md"
	if err := os.WriteFile(md, []byte(markdown(rep)), 0o644); err != nil {
		return nil, err
	}
	if cfg.Charts != "" {
		if err := writeCharts(cfg.Charts, rep); err != nil {
			return nil, err
		}
	}
	return rep, nil
}

func (c Config) drainKinds() []drainKind {
	kinds := append(slices.Clone(drainKinds), keyedKinds(c.Keys)...)
	if c.WhatIf {
		kinds = append(kinds, drainKind{relayOneCommit, 1, 0})
	}
	if len(c.Drain) == 0 {
		return kinds
	}
	var out []drainKind
	for _, d := range kinds {
		if slices.Contains(c.Drain, strings.TrimPrefix(d.name(), "drain/")) {
			out = append(out, d)
		}
	}
	return out
}

// runs reports whether the run includes group: every group when -only is
// not given, except the opt-in ones (sustained), which run only when named.
func (c Config) runs(group string) bool {
	if group == "sustained" {
		return slices.Contains(c.Only, group)
	}
	return len(c.Only) == 0 || slices.Contains(c.Only, group)
}

func writeReport(path string, rep *Report) error {
	if dir := filepath.Dir(path); dir != "" {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return err
		}
	}
	b, err := json.MarshalIndent(rep, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(b, '\n'), 0o644)
}

func commandLine() string {
	return "go run ./cmd/outbox-bench " + strings.Join(os.Args[1:], " ")
}

// loadavg is `uptime`'s load average (the machine is shared).
func loadavg() string {
	if b, err := os.ReadFile("/proc/loadavg"); err == nil {
		f := strings.Fields(string(b))
		if len(f) >= 3 {
			return strings.Join(f[:3], " ")
		}
	}
	out, _ := exec.Command("uptime").Output()
	return strings.TrimSpace(string(out))
}

func printTable(w io.Writer, rep *Report) {
	fmt.Fprintf(w, "machine: %d CPUs, PostgreSQL %s, %s, load %s -> %s, %d repetitions\n\n",
		rep.Machine.NProc, rep.Machine.PostgreSQL, rep.Machine.GoVersion, rep.Machine.LoadBefore, rep.Machine.LoadAfter, rep.Config.Reps)
	fmt.Fprintf(w, "%-34s %-7s %10s %10s %10s %7s\n", "scenario", "unit", "median", "min", "max", "spread")
	for _, r := range rep.Results {
		fmt.Fprintf(w, "%-34s %-7s %10s %10s %10s %6.0f%%\n", r.Name, r.Unit, num(r.Median), num(r.Min), num(r.Max), 100*r.Spread)
	}
	fmt.Fprintf(w, "\n%-62s %8s %8s %s\n", "target", "ratio", "needed", "met")
	for _, t := range rep.Targets {
		fmt.Fprintf(w, "%-62s %8.2f %8s %s\n", t.Name, t.Ratio, t.needText(), yes(t.Met))
	}
	if len(rep.WAL) > 0 {
		fmt.Fprintf(w, "\nWAL per row (EXPLAIN ANALYZE WAL, batch of 100, rolled back):\n")
		for _, c := range rep.WAL {
			fmt.Fprintf(w, "  %-48s %7.0f bytes %5.1f records (FPI %d) %6.1f µs/row\n", c.Statement, c.BytesPerRow, c.RecordsPerRow, c.FPI, c.ExecUSPerRow)
		}
	}
	if rep.ExplainClaim != "" {
		fmt.Fprintf(w, "\nclaim at the largest backlog:\n%s", rep.ExplainClaim)
	}
	if rep.ExplainParkedHead != "" {
		fmt.Fprintf(w, "\nclaim with %d rows behind a parked head:\n%s", rep.Config.ParkedBehind, rep.ExplainParkedHead)
	}
}

func num(v float64) string {
	if v >= 100 {
		return strconv.FormatFloat(v, 'f', 0, 64)
	}
	return strconv.FormatFloat(v, 'f', 2, 64)
}

func yes(b bool) string {
	if b {
		return "yes"
	}
	return "NO"
}
