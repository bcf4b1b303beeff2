package console

import (
	"fmt"
	"time"
)

// chart is a bar chart drawn on the server as SVG: one bar per minute. The
// template writes it with presentation attributes only (no style attribute,
// no script), so it needs nothing the Content-Security-Policy refuses.
type chart struct {
	Title  string
	Width  int
	Height int
	Bars   []bar
	Max    int64
	Total  int64
	From   string // first minute shown (UTC)
	To     string // last minute shown (UTC)
}

type bar struct {
	X, Y, W, H int
	Label      string // minute and count, the bar's tooltip
}

const (
	chartWidth  = 720
	chartHeight = 120
)

// minuteChart draws counts per minute for the minutes (from, to], from the
// database's (minute, count) pairs; minutes missing from them are zero.
func minuteChart(title string, to time.Time, minutes int, counts map[time.Time]int64) chart {
	end := to.UTC().Truncate(time.Minute)
	c := chart{Title: title, Width: chartWidth, Height: chartHeight}
	vals := make([]int64, minutes)
	for i := range minutes {
		m := end.Add(-time.Duration(minutes-1-i) * time.Minute)
		vals[i] = counts[m]
		c.Total += vals[i]
		c.Max = max(c.Max, vals[i])
	}
	w := chartWidth / minutes
	for i, v := range vals {
		h := 0
		if c.Max > 0 {
			h = int(v * int64(chartHeight-4) / c.Max)
		}
		if v > 0 && h == 0 {
			h = 1
		}
		m := end.Add(-time.Duration(minutes-1-i) * time.Minute)
		c.Bars = append(c.Bars, bar{X: i * w, Y: chartHeight - h, W: max(1, w-1), H: h, Label: fmt.Sprintf("%s: %d", m.Format("15:04"), v)})
	}
	c.From = end.Add(-time.Duration(minutes-1) * time.Minute).Format("15:04")
	c.To = end.Format("15:04 UTC")
	return c
}
