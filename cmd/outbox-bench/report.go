package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

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
