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
		fmt.Fprintf(&b, "| %s | %.2f | %.2f | %s | %s |\n", t.Name, t.Ratio, t.Need, yes(t.Met), t.Note)
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
	return b.String()
}
