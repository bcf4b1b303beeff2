package main

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
)

// Target is one of issue 7's targets, judged on medians of the same run.
type Target struct {
	Name  string  `json:"name"`
	Ratio float64 `json:"ratio"` // measured ratio (higher is better, see Name)
	Need  float64 `json:"need"`  // the ratio the target asks for
	Met   bool    `json:"met"`
	Note  string  `json:"note,omitempty"`
	// AtMost turns the target around: met when Ratio <= Need (a cost the
	// issue bounds from above, e.g. WAL per message against the minimal
	// relay's). A target whose cells did not run is never met.
	AtMost bool `json:"at_most,omitempty"`
}

// needText is the "needed" column: the bound, with "≤" when it is one from
// above.
func (t Target) needText() string {
	if t.AtMost {
		return fmt.Sprintf("≤ %.2f", t.Need)
	}
	return fmt.Sprintf("%.2f", t.Need)
}

// pairRatioBest is pairRatio against the best (lowest) of the cells bs in
// each repetition: a cost of a against the cheapest variant of another
// relay measured in the same repetition (cells missing from the run, and
// samples of 0, not measured, are left out; 0 when nothing is left).
func (c *collector) pairRatioBest(a string, bs ...string) float64 {
	return c.pairRatioAgainst(a, func(v, best float64) bool { return v < best }, bs...)
}

// pairRatioFastest is pairRatio against the fastest (highest) of the cells
// bs in each repetition: a rate of a against the best variant of another
// relay measured in the same repetition.
func (c *collector) pairRatioFastest(a string, bs ...string) float64 {
	return c.pairRatioAgainst(a, func(v, best float64) bool { return v > best }, bs...)
}

// pairRatioAgainst is the median over repetitions of a against the sample
// of bs that is better than the others (better) in that repetition.
func (c *collector) pairRatioAgainst(a string, better func(v, best float64) bool, bs ...string) float64 {
	ra, ok := c.by[a]
	if !ok {
		return 0
	}
	var rs []float64
	for i := range ra.Samples {
		best := 0.0
		for _, b := range bs {
			if rb, ok := c.by[b]; ok && i < len(rb.Samples) && rb.Samples[i] > 0 && (best == 0 || better(rb.Samples[i], best)) {
				best = rb.Samples[i]
			}
		}
		if best > 0 && ra.Samples[i] > 0 {
			rs = append(rs, ratio(ra.Samples[i], best))
		}
	}
	slices.Sort(rs)
	return median(rs)
}

func ratio(a, b float64) float64 {
	if b == 0 {
		return 0
	}
	return a / b
}

// pairRatio is the median over repetitions of a/b taken within each
// repetition: the two cells ran back to back, so a change of load on the
// shared machine between repetitions moves both and cancels out.
func (c *collector) pairRatio(a, b string) float64 {
	ra, okA := c.by[a]
	rb, okB := c.by[b]
	if !okA || !okB {
		return 0
	}
	var rs []float64
	for i := range min(len(ra.Samples), len(rb.Samples)) {
		rs = append(rs, ratio(ra.Samples[i], rb.Samples[i]))
	}
	slices.Sort(rs)
	return median(rs)
}

func targets(cfg Config, c *collector) []Target {
	var out []Target
	add := func(name string, r, need float64, note string) {
		out = append(out, Target{Name: name, Ratio: r, Need: need, Met: r >= need, Note: note})
	}
	for _, w := range cfg.Writers {
		for _, b := range cfg.PerTx {
			pub := writeName(implPublisher, w, b)
			add(fmt.Sprintf("write w%d b%d: publisher / raw INSERT", w, b), c.pairRatio(pub, writeName(implRaw, w, b)), 0.9, "")
			add(fmt.Sprintf("write w%d b%d: publisher / watermill-sql+envelope", w, b), c.pairRatio(pub, writeName(implWatermill, w, b)), 1.0, "")
			add(fmt.Sprintf("write w%d b%d: publisher / raw INSERT prepared", w, b), c.pairRatio(pub, writeName(implRawPrepared, w, b)), 0.9, "evidence: both prepared")
			add(fmt.Sprintf("write w%d b%d: publisher unprepared / raw INSERT", w, b), c.pairRatio(writeName(implPublisherPlain, w, b), writeName(implRaw, w, b)), 0.9, "evidence: neither prepared")
		}
	}
	ours1 := drainName(relayOurs, 1)
	b100 := drainName(relayOursB100, 1)
	add("drain: outbox x1 / watermill tuned", c.pairRatio(ours1, drainName(relayWMTuned, 1)), 1.5, "our defaults (claims of 100 growing to 1000 while behind) against watermill's 1000 per query"+c.cpuNote(ours1, drainName(relayWMTuned, 1)))
	add("drain: outbox batch 100 x1 / minimal SKIP LOCKED relay", c.pairRatio(b100, drainName(relayMinimal, 1)), 0.8, "both batch 100, fixed"+c.cpuNote(b100, drainName(relayMinimal, 1)))
	add("drain: outbox x1 / minimal SKIP LOCKED relay", c.pairRatio(ours1, drainName(relayMinimal, 1)), 0.8, "evidence: our defaults against the minimal relay's 100"+c.cpuNote(ours1, drainName(relayMinimal, 1)))
	add("drain: outbox x4 / outbox x1", c.pairRatio(drainName(relayOurs, 4), ours1), 1.0, strings.TrimPrefix(c.cpuNote(drainName(relayOurs, 4), ours1), "; "))
	add("drain: prefetch on (default) / DisablePrefetch, defaults", c.pairRatio(ours1, drainName(relayOursNoPF, 1)), 1.0, "pipelining: not a target of issue 7, kept as evidence")
	add("drain: prefetch on (default) / DisablePrefetch, batch 1000", c.pairRatio(drainName(relayOursTuned, 1), drainName(relayOursTunedNoPF, 1)), 1.0, "pipelining: not a target of issue 7, kept as evidence")
	tuned := drainName(relayOursTuned, 1)
	add("drain: outbox batch 1000 x1 / watermill tuned", c.pairRatio(tuned, drainName(relayWMTuned, 1)), 1.5, "both read 1000 rows per query"+c.cpuNote(tuned, drainName(relayWMTuned, 1)))
	add("drain: outbox batch 1000 x1 / minimal SKIP LOCKED relay batch 1000", c.pairRatio(tuned, drainName(relayMinimalTuned, 1)), 0.8, "both batch 1000"+c.cpuNote(tuned, drainName(relayMinimalTuned, 1)))
	// Lower is better for latency and load: the ratio is theirs / ours.
	add("latency p99: watermill tuned / outbox (LISTEN)", c.pairRatio(latencyName(relayWMTuned, "p99"), latencyName(relayOurs, "p99")), 1.0, "ours <= tuned")
	add("idle load: watermill tuned / outbox", c.pairRatio(idleName(relayWMTuned), idleName(relayOurs)), 10, "xact/s, ours >= 10x lower")
	keyedTargets(cfg, c, add)
	addMax := func(name string, r, need float64, measured bool, note string) {
		out = append(out, Target{Name: name, Ratio: r, Need: need, Met: measured && r <= need, Note: note, AtMost: true})
	}
	laneTargets(cfg, c, addMax)
	laneDrainTargets(c, add, addMax)
	sustainedTargets(cfg, c, add)
	if cfg.WhatIf {
		add("what-if: prototype 1 commit per batch / outbox x1", c.pairRatio(drainName(relayOneCommit, 1), ours1), 1.0, "a candidate pass shape, not the product")
	}
	if len(cfg.ScaleBacklogs) >= 2 {
		lo, hi := cfg.ScaleBacklogs[0], cfg.ScaleBacklogs[len(cfg.ScaleBacklogs)-1]
		note := ""
		if hi < 1000000 {
			note = "1M not run (opt-in -1m); largest backlog run instead"
		}
		add(fmt.Sprintf("scale: drain at %d / at %d", hi, lo), c.pairRatio(scaleName("outbox", hi), scaleName("outbox", lo)), 0.8, note)
	}
	if n := cfg.ScaleWatermill; n > 0 {
		add(fmt.Sprintf("scale: outbox / watermill tuned at %d", n),
			c.pairRatio(scaleName("outbox", n), scaleName(relayWMTuned, n)), 2.0,
			cmp.Or(ifMissing(c, scaleName("outbox", n), "outbox was not drained at this backlog (add it to -scale)"), "our defaults (claims of 100 growing to 1000) vs batch 1000"))
		add(fmt.Sprintf("scale: outbox batch 1000 / watermill tuned at %d", n),
			c.pairRatio(scaleName(relayOursTuned, n), scaleName(relayWMTuned, n)), 2.0, "both read 1000 rows per query")
	}
	return out
}

func ifMissing(c *collector, name, note string) string {
	if _, ok := c.by[name]; ok {
		return ""
	}
	return note
}

// keyedTargets are issue 14's and issue 19's targets: keyed drains, the
// claim under a parked head, steady-load latency, recovery after an outage,
// and the cost of LockOrderingKeys. Each names what it compares; a target
// whose cells did not run says so in its note (and is not met).
func keyedTargets(cfg Config, c *collector, add func(name string, r, need float64, note string)) {
	missing := func(names ...string) string {
		for _, n := range names {
			if _, ok := c.by[n]; !ok {
				return "not measured in this run (" + n + " missing)"
			}
		}
		return ""
	}
	ours1 := drainName(relayOurs, 1)
	cpuNote := c.cpuNote
	for _, k := range cfg.Keys {
		keyed := drainKind{relayOurs, 1, k}.name()
		if k >= 10 {
			add(fmt.Sprintf("drain keyed: %d keys / unkeyed, defaults", k), c.pairRatio(keyed, ours1), 0.5,
				cmp.Or(missing(keyed, ours1), "both at defaults, same backlog"+cpuNote(keyed, ours1)))
		}
		if kt, ut := (drainKind{relayOursTuned, 1, k}).name(), drainName(relayOursTuned, 1); k >= 10 {
			add(fmt.Sprintf("drain keyed: %d keys / unkeyed, batch 1000", k), c.pairRatio(kt, ut), 0.5,
				cmp.Or(missing(kt, ut), "evidence (the target is at defaults): both batch 1000"+cpuNote(kt, ut)))
		}
		if k == 1 {
			wm := drainName(relayWMTuned, 1)
			add("drain keyed: 1 key (total order) / watermill tuned", c.pairRatio(keyed, wm), 1.0,
				cmp.Or(missing(keyed, wm), "ours at defaults (claims of 100 growing to 1000) vs batch 1000; both keep total order"+cpuNote(keyed, wm)))
		}
	}
	cases := claimCostCases(cfg)
	parked, clean := claimCostName(cases[0], "p99"), claimCostName(cases[1], "p99")
	add(fmt.Sprintf("claim p99: clean / %d rows behind a parked head", cfg.ParkedBehind), c.pairRatio(clean, parked), 0.5,
		cmp.Or(missing(parked, clean), "parked p99 <= 2x the same backlog with the head not parked (BlockKey)"))
	unk := claimCostName(cases[2], "p99")
	add(fmt.Sprintf("claim p99: unkeyed / %d rows behind a parked head", cfg.ParkedBehind), c.pairRatio(unk, parked), 0.5,
		cmp.Or(missing(parked, unk), "evidence: against an unkeyed backlog of the same size"))
	many, manyUnk := claimCostName(cases[3], "p99"), claimCostName(cases[4], "p99")
	add(fmt.Sprintf("claim p99: unkeyed / %d keys x %d rows", cfg.ClaimKeys, cfg.ClaimPerKey), c.pairRatio(manyUnk, many), 0.5,
		cmp.Or(missing(many, manyUnk), "evidence, same backlog size"))
	// Lower is better for latency and time: the ratio is theirs / ours.
	sOurs, sWM := steadyName(relayOurs, "p99"), steadyName(relayWMTuned, "p99")
	steadyNote := "half the unkeyed drain rate, same offered load for both"
	if o, ok := c.by[steadyName(relayOurs, "offered")]; ok {
		co, cw := c.by[steadyName(relayOurs, "committed")], c.by[steadyName(relayWMTuned, "committed")]
		if co != nil && cw != nil {
			steadyNote += fmt.Sprintf(" (offered %.0f msg/s; committed: ours %.0f, watermill %.0f)",
				median(sortedCopy(o.Samples)), median(sortedCopy(co.Samples)), median(sortedCopy(cw.Samples)))
		}
	}
	add(fmt.Sprintf("steady load p99: watermill tuned / outbox (%d keys, LISTEN)", cfg.SteadyKeys), c.pairRatio(sWM, sOurs), 1.0,
		cmp.Or(missing(sOurs, sWM), steadyNote))
	allowed, after := recoveryName(relayOurs, "allowed"), recoveryName(relayOurs, "after-outage")
	recNote := fmt.Sprintf("recovery-to-empty <= undisturbed drain + one breaker probe interval (DefaultBreakerProbeMax %s)", breakerProbeInterval)
	if r, ok := c.by[recoveryName(relayOurs, "undelivered")]; ok && slices.Max(r.Samples) > 0 {
		recNote += fmt.Sprintf("; up to %.0f messages never arrived", slices.Max(r.Samples))
	}
	if wm, ok := c.by[recoveryName(relayWMTuned, "after-outage")]; ok {
		if o, ok := c.by[after]; ok {
			recNote += fmt.Sprintf("; recovery to empty %.1f s, watermill tuned %.1f s (medians)", median(sortedCopy(o.Samples)), median(sortedCopy(wm.Samples)))
		}
	}
	if ma, ok := c.by[recoveryName(relayOurs, "max-attempts")]; ok {
		ex := c.by[recoveryName(relayOurs, "exhausted")]
		recNote += fmt.Sprintf("; after the outage rows had spent up to %.0f attempts (retry clock running), %.0f EXHAUSTED",
			slices.Max(ma.Samples), slices.Max(ex.Samples))
	}
	add(fmt.Sprintf("recovery after a %s outage: allowed / outbox", cfg.Outage), c.pairRatio(allowed, after), 1.0,
		cmp.Or(missing(allowed, after), recNote))
	for _, w := range cfg.Writers {
		for _, b := range cfg.PerTx {
			locked, plain := writeName(implPublisherLocked, w, b), writeName(implPublisherKeyed, w, b)
			add(fmt.Sprintf("write w%d b%d: LockOrderingKeys / without, keyed", w, b), c.pairRatio(locked, plain), 0.95,
				cmp.Or(missing(locked, plain), fmt.Sprintf("%d keys; the default if it costs <= 5%%", cfg.WriteKeys)))
		}
	}
}

// cpuNote is "; relay CPU a vs b µs/msg" for two drain cells (medians), or
// "" when either has no CPU figure.
func (c *collector) cpuNote(a, b string) string {
	ca, okA := c.by[drainCPUName(a)]
	cb, okB := c.by[drainCPUName(b)]
	if !okA || !okB {
		return ""
	}
	return fmt.Sprintf("; relay CPU %.1f vs %.1f µs/msg", median(sortedCopy(ca.Samples)), median(sortedCopy(cb.Samples)))
}

func sortedCopy(v []float64) []float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	return s
}

// laneTargets are the lane scheme's cost targets (issue 30), each bounded
// from above: WAL and row versions per relayed message, and the claim's
// server time per row with 4 relays against 1.
func laneTargets(cfg Config, c *collector, addMax func(name string, r, need float64, measured bool, note string)) {
	// WAL: this run's database's records (pg_walinspect), a cluster-wide
	// LSN difference beside it in the note (the server is shared); once
	// with the full-page images the CHECKPOINT before the drain causes (a
	// backlog that waited across a checkpoint) and once without (rows
	// relayed in the checkpoint cycle that wrote them: the steady state).
	for _, part := range []struct{ suffix, name, note string }{
		{"/own", "WAL per relayed message", "WAL records of this run's database over the drain (pg_walinspect; after the fill and a CHECKPOINT, so with a full-page image of every page the drain writes first) / messages"},
		{"/own/records", "WAL per relayed message without full-page images", "WAL records of this run's database over the drain (pg_walinspect) less their full-page images (the steady state: rows relayed in the checkpoint cycle that wrote them) / messages"},
	} {
		own := func(n string) string { return n + part.suffix }
		minimal := []string{walName(drainName(relayMinimal, 1)), walName(drainName(relayMinimalTuned, 1))}
		minimalOwn := []string{own(minimal[0]), own(minimal[1])}
		minRan := slices.ContainsFunc(minimalOwn, func(n string) bool { _, ok := c.by[n]; return ok })
		walNote := part.note + ", against the minimal relay's lower of batch 100 and 1000 in the same repetition"
		for _, d := range []drainKind{{relayOursLanes, 1, 0}, {relayOursLanes, 4, 0}, {relayOurs, 1, 0}} {
			w := walName(d.name())
			_, ok := c.by[own(w)]
			r := c.pairRatioBest(own(w), minimalOwn...)
			note := walNote + fmt.Sprintf("; cluster-wide pg_wal_lsn_diff: %.2f", c.pairRatioBest(w, minimal...))
			switch {
			case !ok || !minRan:
				note = "not measured in this run (" + own(w) + " or " + minimalOwn[0] + "/" + minimalOwn[1] + " missing)"
			case r == 0:
				note = "this database's WAL could not be read (pg_walinspect missing or the WAL recycled): " + note
			case d.kind == relayOurs:
				note = "evidence (per-row leases): " + note
			}
			addMax(fmt.Sprintf("%s: %s x%d / minimal relay (best batch)", part.name, d.kind, d.relays), r, 1.0, ok && minRan && r > 0, note)
		}
	}
	for _, d := range []drainKind{{relayOursLanes, 1, 0}, {relayOursLanes, 4, 0}} {
		v := versionsName(d.name())
		r, ok := c.by[v]
		val, note := 0.0, "pg_stat_user_tables.n_tup_upd / messages (a count, not a ratio: the median over repetitions)"
		if ok {
			val = median(sortedCopy(r.Samples))
		} else {
			note = "not measured in this run (" + v + " missing)"
		}
		addMax(fmt.Sprintf("row versions per relayed message: %s x%d", d.kind, d.relays), val, 1.1, ok, note)
	}
	x1, x4 := laneClaimName(1), laneClaimName(4)
	_, ok1 := c.by[x1]
	_, ok4 := c.by[x4]
	note := fmt.Sprintf("claim statement time per claimed row, %d relays claiming concurrently on their own lanes against 1 relay on all of them (batch %d, same backlog)", 4, cfg.LaneClaimBatch)
	if !ok1 || !ok4 {
		note = "not measured in this run (" + x1 + " or " + x4 + " missing)"
	} else {
		if _, ok := c.by[x4+"/cpu"]; ok {
			note += fmt.Sprintf("; their server backends' CPU per row (schedstat): %.2fx", c.pairRatio(x4+"/cpu", x1+"/cpu"))
		}
		if _, ok := c.by[laneClaimName(2)]; ok {
			note += fmt.Sprintf("; 2 relays: %.2fx", c.pairRatio(laneClaimName(2), x1))
		}
		if _, ok := c.by[laneClaimSerialName(4)]; ok {
			note += fmt.Sprintf("; 4 relays one claim at a time: %.2fx", c.pairRatio(laneClaimSerialName(4), x1))
		}
	}
	addMax("claim per row, lanes: 4 relays / 1 relay", c.pairRatio(x4, x1), 1.2, ok1 && ok4, note)
}

// laneDrainTargets are issue 30's drain targets, for both fence schemes:
// the drain at defaults against the minimal relay at its best batch (batch
// 100 or 1000, whichever was faster in that repetition; 0.9 required, 1.0
// the goal), 4 relays against 1 (unkeyed and 100 keys), and the relay's CPU
// per message against the minimal relay's lower one.
func laneDrainTargets(c *collector, add func(name string, r, need float64, note string), addMax func(name string, r, need float64, measured bool, note string)) {
	minimal := []string{drainName(relayMinimal, 1), drainName(relayMinimalTuned, 1)}
	for _, kind := range []string{relayOurs, relayOursLanes} {
		one := drainName(kind, 1)
		add(fmt.Sprintf("drain: %s x1 / minimal relay (best batch)", kind), c.pairRatioFastest(one, minimal...), 0.9,
			"the minimal relay's faster of batch 100 and 1000 in each repetition (1.0 is the goal)")
		cpu := c.pairRatioBest(drainCPUName(one), drainCPUName(minimal[0]), drainCPUName(minimal[1]))
		_, ok := c.by[drainCPUName(one)]
		addMax(fmt.Sprintf("relay CPU per message: %s x1 / minimal relay (lower of batch 100 and 1000)", kind), cpu, 1.5, ok && cpu > 0,
			"this process's CPU per relayed message (the downstream's share included in both)")
	}
	lanes1, lanes4 := drainName(relayOursLanes, 1), drainName(relayOursLanes, 4)
	add("drain: outbox-lanes x4 / outbox-lanes x1", c.pairRatio(lanes4, lanes1), 1.0, strings.TrimPrefix(c.cpuNote(lanes4, lanes1), "; "))
	k1, k4 := drainKind{relayOursLanes, 1, 100}.name(), drainKind{relayOursLanes, 4, 100}.name()
	add("drain: outbox-lanes-k100 x4 / outbox-lanes-k100 x1", c.pairRatio(k4, k1), 1.0, strings.TrimPrefix(c.cpuNote(k4, k1), "; "))
	r1, r4 := drainKind{relayOurs, 1, 100}.name(), drainKind{relayOurs, 4, 100}.name()
	add("drain: outbox-k100 x4 / outbox-k100 x1", c.pairRatio(r4, r1), 1.0, "evidence (per-row leases)"+c.cpuNote(r4, r1))
	// The mixed backlog (mixedKeys: 3 hot keys, 4,999 small ones, half the
	// rows without a key), against the unkeyed one, with the keyed drains'
	// 0.5 of issue 14; and lanes' 4 relays against 1 on it.
	for _, kind := range []string{relayOurs, relayOursLanes} {
		mix, unk := drainKind{kind, 1, mixKeys}.name(), drainName(kind, 1)
		add(fmt.Sprintf("drain mixed: %s-mix x1 / %s x1", kind, kind), c.pairRatio(mix, unk), 0.5,
			cmp.Or(ifMissing(c, mix, "not measured in this run ("+mix+" missing)"), "evidence: hot, small and no keys against no keys, same backlog size"+c.cpuNote(mix, unk)))
	}
	m1, m4 := drainKind{relayOursLanes, 1, mixKeys}.name(), drainKind{relayOursLanes, 4, mixKeys}.name()
	add("drain: outbox-lanes-mix x4 / outbox-lanes-mix x1", c.pairRatio(m4, m1), 1.0,
		cmp.Or(ifMissing(c, m4, "not measured in this run ("+m4+" missing)"), "evidence"+c.cpuNote(m4, m1)))
}
