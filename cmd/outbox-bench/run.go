package main

import (
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"time"
)

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
	keys   int // ordering keys of the backlog; 0: none, mixKeys: mixedKeys
}

// mixKeys is drainKind.keys of a cell on the mixed backlog (mixedKeys).
const mixKeys = -1

// name is the cell's result name: drain/outbox/x1, drain/outbox-k10/x1,
// drain/outbox-lanes-mix/x1.
func (d drainKind) name() string {
	switch {
	case d.keys == mixKeys:
		return drainName(d.kind+"-mix", d.relays)
	case d.keys > 0:
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
	{relayOursLanes, 1, 0}, {relayOursLanes, 4, 0}, {relayOursLanes, 1, 100}, {relayOursLanes, 4, 100}, {relayOurs, 4, 100},
	{relayOurs, 1, mixKeys}, {relayOursLanes, 1, mixKeys}, {relayOursLanes, 4, mixKeys},
	// Evidence for Config.ShareConnection: the lane relay with its claims
	// and outcomes on one backend, beside the cells above.
	{relayOursLanesShare, 1, 0}, {relayOursLanesShare, 4, 0}, {relayOursLanesShare, 4, 100}}

// writeImpls are the write side's implementations, run back to back per cell.
var writeImpls = []string{implPublisher, implWatermill, implRaw, implPublisherPlain, implRawPrepared}

var latencyKinds = []string{relayOurs, relayWMDefault, relayWMTuned}

// idleKinds are the relays of the idle cells: the latency cells' and the
// lane relay (issue 30: its floors and its lanes' upkeep run beside its
// polls).
var idleKinds = append(append([]string(nil), latencyKinds...), relayOursLanes)

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
	if cfg.LaneClaimWarm < 0 {
		return nil, fmt.Errorf("-lane-claim-warm must be at least 0, got %d", cfg.LaneClaimWarm)
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
			c.add("cpu", drainCPUName(d.name())+"/server", "µs/msg", st.serverUSPerMsg)
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
			logf("  %-28s %10.0f msg/s %7.1f µs CPU/msg (server %.1f) %5.2f row versions/msg (%.2f HOT) %6.0f WAL B/msg (%.0f this database's, %.0f without full-page images)", d.name(), st.rate, st.cpuUSPerMsg, st.serverUSPerMsg, st.versions, st.hot, st.walPerMsg, st.walOwnPerMsg, st.walOwnPerMsg-st.walOwnFPIPerMsg)
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
		for _, k := range idleKinds {
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
