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
	"flag"
	"fmt"
	"os"
	"os/signal"
	"runtime/pprof"
	"strconv"
	"strings"
)

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
	flag.IntVar(&cfg.LaneClaimWarm, "lane-claim-warm", cfg.LaneClaimWarm, "claimcost: each lane owner's first claims, not timed (they warm its connection up)")
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
