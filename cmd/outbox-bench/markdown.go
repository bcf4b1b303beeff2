package main

import (
	"fmt"
	"strings"
)

// markdown renders the report as the tables BENCHMARKS.md shows.
func markdown(rep *Report) string {
	var b strings.Builder
	m := rep.Machine
	fmt.Fprintf(&b, "Run %s → %s, %d CPUs, PostgreSQL %s, %s, load average %s before / %s after, %d repetitions.\n\n",
		rep.Started.Format("2006-01-02 15:04Z"), rep.Finished.Format("15:04Z"), m.NProc, m.PostgreSQL, m.GoVersion,
		m.LoadBefore, m.LoadAfter, rep.Config.Reps)
	fmt.Fprintf(&b, "Command: `%s`\n\n", rep.Command)
	b.WriteString("| scenario | unit | median | min | max | spread |\n|---|---|---:|---:|---:|---:|\n")
	for _, r := range rep.Results {
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %.0f%% |\n", r.Name, r.Unit, num(r.Median), num(r.Min), num(r.Max), 100*r.Spread)
	}
	b.WriteString("\nTarget ratios are the median over repetitions of the ratio taken within each repetition (the two cells ran minutes apart at most).\n")
	b.WriteString("\n| target | ratio | needed | met | note |\n|---|---:|---:|---|---|\n")
	for _, t := range rep.Targets {
		fmt.Fprintf(&b, "| %s | %.2f | %s | %s | %s |\n", t.Name, t.Ratio, t.needText(), yes(t.Met), t.Note)
	}
	if len(rep.WAL) > 0 {
		b.WriteString("\nWAL per row (EXPLAIN (ANALYZE, WAL), batch of 100, rolled back):\n\n| statement | WAL bytes/row | WAL records/row | FPI | server µs/row |\n|---|---:|---:|---:|---:|\n")
		for _, c := range rep.WAL {
			fmt.Fprintf(&b, "| %s | %.0f | %.1f | %d | %.1f |\n", c.Statement, c.BytesPerRow, c.RecordsPerRow, c.FPI, c.ExecUSPerRow)
		}
	}
	if rep.ExplainClaim != "" {
		fmt.Fprintf(&b, "\nThe claim at the largest backlog (EXPLAIN (ANALYZE, BUFFERS), rolled back):\n\n```\n%s```\n", rep.ExplainClaim)
	}
	cpuTable(&b, rep)
	recoveryTable(&b, rep)
	if rep.ExplainParkedHead != "" {
		fmt.Fprintf(&b, "\nThe claim with %d rows behind a parked head (BlockKey; EXPLAIN (ANALYZE, BUFFERS), rolled back):\n\n```\n%s```\n",
			rep.Config.ParkedBehind, rep.ExplainParkedHead)
	}
	return b.String()
}

// medianOf is the median of the named result (0 when it is missing).
func medianOf(rep *Report, name string) (float64, bool) {
	for _, r := range rep.Results {
		if r.Name == name {
			return r.Median, true
		}
	}
	return 0, false
}

// cpuTable shows every drain cell's relay CPU per message beside the
// minimal relay's at the same batch size.
func cpuTable(b *strings.Builder, rep *Report) {
	minimal := map[bool]string{false: drainCPUName(drainName(relayMinimal, 1)), true: drainCPUName(drainName(relayMinimalTuned, 1))}
	var rows []string
	for _, r := range rep.Results {
		if r.Group != "drain" {
			continue
		}
		cpu, ok := medianOf(rep, drainCPUName(r.Name))
		if !ok {
			continue
		}
		tuned := strings.Contains(r.Name, "-tuned")
		minCPU, ok := medianOf(rep, minimal[tuned])
		cell := "—"
		if ok {
			cell = fmt.Sprintf("%.1f (%.2fx)", minCPU, ratio(cpu, minCPU))
		}
		rows = append(rows, fmt.Sprintf("| %s | %s | %.1f | %s |\n", r.Name, num(r.Median), cpu, cell))
	}
	if len(rows) == 0 {
		return
	}
	b.WriteString("\nRelay CPU per relayed message: this process's getrusage(RUSAGE_SELF) user + system time over the drain, divided by the\n" +
		"messages (medians over repetitions). Every relay runs in this one process, and so does the GoChannel's consumer, which costs\n" +
		"the same per message in every cell and so cancels in the comparison; the minimal relay is the one at the same batch size.\n\n" +
		"| drain cell | msg/s | µs/msg | minimal relay µs/msg (ours / minimal) |\n|---|---:|---:|---:|\n")
	for _, r := range rows {
		b.WriteString(r)
	}
}

// recoveryTable shows the outage cells side by side.
func recoveryTable(b *strings.Builder, rep *Report) {
	var rows []string
	for _, k := range recoveryKinds {
		after, ok := medianOf(rep, recoveryName(k, "after-outage"))
		if !ok {
			continue
		}
		und, _ := medianOf(rep, recoveryName(k, "undisturbed-drain"))
		lost, _ := medianOf(rep, recoveryName(k, "undelivered"))
		refused, _ := medianOf(rep, recoveryName(k, "refused-publishes"))
		extra := "—"
		if ex, ok := medianOf(rep, recoveryName(k, "exhausted")); ok {
			ma, _ := medianOf(rep, recoveryName(k, "max-attempts"))
			extra = fmt.Sprintf("%.0f EXHAUSTED, max attempts %.0f", ex, ma)
		}
		rows = append(rows, fmt.Sprintf("| %s | %.2f | %.2f | %.0f | %.0f | %s |\n", k, und, after, lost, refused, extra))
	}
	if len(rows) == 0 {
		return
	}
	fmt.Fprintf(b, "\nRecovery after a %s downstream outage (%d-row backlog; every Publish fails as unavailable meanwhile), medians in seconds:\n\n", rep.Config.Outage, rep.Config.RecoveryBacklog)
	b.WriteString("| relay | undisturbed drain | recovery to empty | undelivered | publishes refused during the outage | rows afterwards |\n|---|---:|---:|---:|---:|---|\n")
	for _, r := range rows {
		b.WriteString(r)
	}
}
