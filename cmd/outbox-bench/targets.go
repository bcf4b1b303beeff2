package main

import "fmt"

// Target is one of issue 7's targets, judged on medians of the same run.
type Target struct {
	Name  string  `json:"name"`
	Ratio float64 `json:"ratio"` // measured ratio (higher is better, see Name)
	Need  float64 `json:"need"`  // the ratio the target asks for
	Met   bool    `json:"met"`
	Note  string  `json:"note,omitempty"`
}

func ratio(a, b float64) float64 {
	if b == 0 {
		return 0
	}
	return a / b
}

func targets(cfg Config, c *collector) []Target {
	var out []Target
	add := func(name string, r, need float64, note string) {
		out = append(out, Target{Name: name, Ratio: r, Need: need, Met: r >= need, Note: note})
	}
	for _, w := range cfg.Writers {
		for _, b := range cfg.PerTx {
			pub := c.median(writeName(implPublisher, w, b))
			add(fmt.Sprintf("write w%d b%d: publisher / raw INSERT", w, b), ratio(pub, c.median(writeName(implRaw, w, b))), 0.9, "")
			add(fmt.Sprintf("write w%d b%d: publisher / watermill-sql+envelope", w, b), ratio(pub, c.median(writeName(implWatermill, w, b))), 1.0, "")
		}
	}
	ours1 := c.median(drainName(relayOurs, 1))
	add("drain: outbox x1 / watermill tuned", ratio(ours1, c.median(drainName(relayWMTuned, 1))), 1.5, "")
	add("drain: outbox x1 / minimal SKIP LOCKED relay", ratio(ours1, c.median(drainName(relayMinimal, 1))), 0.8, "")
	add("drain: outbox x4 / outbox x1", ratio(c.median(drainName(relayOurs, 4)), ours1), 1.0, "")
	// Lower is better for latency and load: the ratio is theirs / ours.
	add("latency p99: watermill tuned / outbox (LISTEN)", ratio(c.median(latencyName(relayWMTuned, "p99")), c.median(latencyName(relayOurs, "p99"))), 1.0, "ours <= tuned")
	add("idle load: watermill tuned / outbox", ratio(c.median(idleName(relayWMTuned)), c.median(idleName(relayOurs))), 10, "xact/s, ours >= 10x lower")
	if len(cfg.ScaleBacklogs) >= 2 {
		lo, hi := cfg.ScaleBacklogs[0], cfg.ScaleBacklogs[len(cfg.ScaleBacklogs)-1]
		note := ""
		if hi < 1000000 {
			note = "1M not run (opt-in -1m); largest backlog run instead"
		}
		add(fmt.Sprintf("scale: drain at %d / at %d", hi, lo), ratio(c.median(scaleName("outbox", hi)), c.median(scaleName("outbox", lo))), 0.8, note)
	}
	if n := cfg.ScaleWatermill; n > 0 {
		add(fmt.Sprintf("scale: outbox / watermill tuned at %d", n),
			ratio(c.median(scaleName("outbox", n)), c.median(scaleName(relayWMTuned, n))), 2.0,
			ifMissing(c, scaleName("outbox", n), "outbox was not drained at this backlog (add it to -scale)"))
	}
	return out
}

func ifMissing(c *collector, name, note string) string {
	if _, ok := c.by[name]; ok {
		return ""
	}
	return note
}
