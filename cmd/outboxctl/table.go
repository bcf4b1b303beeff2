package main

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"
)

// table writes aligned columns; Flush must be called.
type table struct{ w *tabwriter.Writer }

func newTable(out io.Writer) *table {
	return &table{w: tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)}
}

func (t *table) row(cols ...any) {
	parts := make([]string, len(cols))
	for i, c := range cols {
		parts[i] = cell(c)
	}
	fmt.Fprintln(t.w, strings.Join(parts, "\t"))
}

func (t *table) flush() error { return t.w.Flush() }

func cell(v any) string {
	switch x := v.(type) {
	case nil:
		return "-"
	case string:
		if x == "" {
			return "-"
		}
		return x
	case time.Time:
		if x.IsZero() {
			return "-"
		}
		return x.UTC().Format(time.RFC3339)
	case time.Duration:
		return x.Round(time.Second).String()
	default:
		return fmt.Sprint(x)
	}
}

func section(out io.Writer, title string) {
	fmt.Fprintf(out, "\n%s\n", title)
}
