package main

import (
	"math"
	"sort"
	"time"
)

// Result is one measured quantity over the repetitions of a run.
type Result struct {
	Name    string    `json:"name"`    // e.g. "write/publisher/w4/b10"
	Group   string    `json:"group"`   // write, drain, latency, idle, scale, claim, retention
	Unit    string    `json:"unit"`    // msg/s, ms, xact/s
	Samples []float64 `json:"samples"` // one per repetition, in run order
	Median  float64   `json:"median"`
	Min     float64   `json:"min"`
	Max     float64   `json:"max"`
	// Spread is (max-min)/median: how much the shared machine moved the
	// number between repetitions.
	Spread float64 `json:"spread"`
}

func (r *Result) finish() {
	if len(r.Samples) == 0 {
		return
	}
	s := append([]float64(nil), r.Samples...)
	sort.Float64s(s)
	r.Min, r.Max = s[0], s[len(s)-1]
	r.Median = median(s)
	if r.Median != 0 {
		r.Spread = (r.Max - r.Min) / r.Median
	}
}

func median(sorted []float64) float64 {
	n := len(sorted)
	if n == 0 {
		return 0
	}
	if n%2 == 1 {
		return sorted[n/2]
	}
	return (sorted[n/2-1] + sorted[n/2]) / 2
}

// percentile of durations (nearest rank), in milliseconds.
func percentileMS(d []time.Duration, p float64) float64 {
	if len(d) == 0 {
		return 0
	}
	s := append([]time.Duration(nil), d...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	k := int(math.Ceil(p/100*float64(len(s)))) - 1
	k = max(0, min(k, len(s)-1))
	return float64(s[k]) / float64(time.Millisecond)
}

// collector accumulates samples by name, keeping first-seen order.
type collector struct {
	order []string
	by    map[string]*Result
}

func newCollector() *collector { return &collector{by: map[string]*Result{}} }

func (c *collector) add(group, name, unit string, v float64) {
	r, ok := c.by[name]
	if !ok {
		r = &Result{Name: name, Group: group, Unit: unit}
		c.by[name] = r
		c.order = append(c.order, name)
	}
	r.Samples = append(r.Samples, v)
}

func (c *collector) results() []Result {
	out := make([]Result, 0, len(c.order))
	for _, n := range c.order {
		r := *c.by[n]
		r.finish()
		out = append(out, r)
	}
	return out
}
