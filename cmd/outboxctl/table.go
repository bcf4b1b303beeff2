package main

import (
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode"
	"unicode/utf8"
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
		return escape(x)
	case time.Time:
		if x.IsZero() {
			return "-"
		}
		return x.UTC().Format(time.RFC3339)
	case time.Duration:
		return x.Round(time.Second).String()
	default:
		return escape(fmt.Sprint(x))
	}
}

// escape returns s with every character a terminal could act on written as
// a Go escape: control characters (ESC, BEL, CR, newline, tab, ...), other
// non-printable runes and bytes that are not UTF-8. Printable text, spaces
// included, is kept as it is. Topics, ids, headers and failure details come
// from applications and brokers, so a table cell must never clear a screen,
// retitle a terminal or start a forged line.
func escape(s string) string {
	if !needsEscape(s) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && size == 1:
			fmt.Fprintf(&b, `\x%02x`, s[i])
		case r == ' ' || unicode.IsPrint(r):
			b.WriteRune(r)
		default:
			q := strconv.QuoteRune(r) // e.g. '\x1b', '\n', '\u200b'
			b.WriteString(q[1 : len(q)-1])
		}
		i += size
	}
	return b.String()
}

func needsEscape(s string) bool {
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		if (r == utf8.RuneError && size == 1) || !(r == ' ' || unicode.IsPrint(r)) {
			return true
		}
		i += size
	}
	return false
}

func section(out io.Writer, title string) {
	fmt.Fprintf(out, "\n%s\n", title)
}
