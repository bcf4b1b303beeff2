package main

import (
	"slices"
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
	LaneClaimWarm  int `json:"lane_claim_warm"` // each owner's first claims, not timed

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
		LaneClaimRows: 80000, LaneClaimBatch: forwarder.DefaultBatchSize, LaneClaimWarm: DefaultLaneClaimWarm, SustainedRows: 20000, SustainedRounds: 6,
	}
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
