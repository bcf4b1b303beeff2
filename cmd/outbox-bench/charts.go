package main

import (
	"fmt"
	"html"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
)

// Charts drawn from a run's results, written as SVG next to BENCHMARKS.md
// (make bench: docs/bench/): the targets (each measured ratio against the
// ratio it needs) and the drain cells (median msg/s with the spread of the
// repetitions). Only what ran is drawn; a chart with nothing to draw is not
// written.

// chartFiles returns the charts of rep by file name.
func chartFiles(rep *Report) map[string]string {
	out := map[string]string{}
	if svg, ok := targetsChart(rep); ok {
		out["targets.svg"] = svg
	}
	if svg, ok := drainChart(rep); ok {
		out["drain.svg"] = svg
	}
	return out
}

// writeCharts writes rep's charts into dir (created if missing).
func writeCharts(dir string, rep *Report) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	for name, svg := range chartFiles(rep) {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(svg), 0o644); err != nil {
			return err
		}
	}
	return nil
}

// bar is one row of a horizontal bar chart.
type bar struct {
	label      string
	value      float64
	lo, hi     float64 // whisker (the repetitions' min and max); both 0: none
	mark       float64 // a vertical tick (the ratio needed); 0: none
	good, show bool    // colour (met / not met); show: colour by good at all
	text       string  // printed after the bar
}

const (
	chartLabelW = 430
	chartBarW   = 360
	chartRowH   = 18
	chartTextW  = 170
)

func targetsChart(rep *Report) (string, bool) {
	var bars []bar
	for _, t := range rep.Targets {
		if t.Ratio == 0 {
			continue // its cells did not run
		}
		bars = append(bars, bar{label: t.Name, value: t.Ratio, mark: t.Need, good: t.Met, show: true,
			text: fmt.Sprintf("%.2f (%s %s)", t.Ratio, "need "+t.needText(), map[bool]string{true: "met", false: "missed"}[t.Met])})
	}
	if len(bars) == 0 {
		return "", false
	}
	return barChart("Targets: measured ratio, tick at the ratio needed", bars), true
}

func drainChart(rep *Report) (string, bool) {
	var bars []bar
	for _, r := range rep.Results {
		if r.Group != "drain" || r.Unit != "msg/s" {
			continue
		}
		bars = append(bars, bar{label: r.Name, value: r.Median, lo: r.Min, hi: r.Max,
			text: fmt.Sprintf("%.0f msg/s (%.0f%% spread)", r.Median, 100*r.Spread)})
	}
	if len(bars) == 0 {
		return "", false
	}
	slices.SortStableFunc(bars, func(a, b bar) int { return strings.Compare(a.label, b.label) })
	return barChart(fmt.Sprintf("Drain: median msg/s of %d repetitions, whisker from the slowest to the fastest", rep.Config.Reps), bars), true
}

// barChart draws bars scaled to the largest value, whisker or tick.
func barChart(title string, bars []bar) string {
	top := 0.0
	for _, b := range bars {
		top = max(top, b.value, b.hi, b.mark)
	}
	if top <= 0 || math.IsNaN(top) || math.IsInf(top, 0) {
		top = 1
	}
	x := func(v float64) float64 { return chartLabelW + chartBarW*v/top }
	w := chartLabelW + chartBarW + chartTextW
	h := 30 + chartRowH*len(bars) + 10
	var s strings.Builder
	fmt.Fprintf(&s, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="11">`+"\n", w, h)
	fmt.Fprintf(&s, `<rect width="%d" height="%d" fill="white"/>`+"\n", w, h)
	fmt.Fprintf(&s, `<text x="4" y="16" font-size="13">%s</text>`+"\n", html.EscapeString(title))
	for i, b := range bars {
		y := 30 + i*chartRowH
		fill := "#4a78b5"
		if b.show {
			fill = map[bool]string{true: "#3a9a4a", false: "#c0413b"}[b.good]
		}
		fmt.Fprintf(&s, `<text x="%d" y="%d" text-anchor="end">%s</text>`+"\n", chartLabelW-6, y+12, html.EscapeString(b.label))
		fmt.Fprintf(&s, `<rect x="%d" y="%d" width="%.1f" height="%d" fill="%s"/>`+"\n", chartLabelW, y+3, x(max(b.value, 0))-chartLabelW, chartRowH-6, fill)
		if b.hi > 0 {
			fmt.Fprintf(&s, `<line x1="%.1f" x2="%.1f" y1="%d" y2="%d" stroke="black"/>`+"\n", x(b.lo), x(b.hi), y+9, y+9)
		}
		if b.mark > 0 {
			fmt.Fprintf(&s, `<line x1="%.1f" x2="%.1f" y1="%d" y2="%d" stroke="black" stroke-width="2"/>`+"\n", x(b.mark), x(b.mark), y+1, y+chartRowH-1)
		}
		fmt.Fprintf(&s, `<text x="%d" y="%d">%s</text>`+"\n", chartLabelW+chartBarW+6, y+12, html.EscapeString(b.text))
	}
	s.WriteString("</svg>\n")
	return s.String()
}
