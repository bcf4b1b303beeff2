// Text for the database: the outcome statement's JSON argument and the
// failure detail's bounds.

package fencing

import (
	"encoding/json"
	"strings"
	"unicode/utf8"
)

// jsonObject writes a JSON object one member at a time. It stays rather than
// encoding/json because the relay builds one per outcome write, on its hot
// path: for 1,000 published rows ({id: token}) it took 0.45 ms and 22
// allocations against encoding/json's 1.12 ms and 2,009 allocations for the
// same map (BenchmarkOutcomeArgument, 2-core machine, 2026-12-03), about
// 0.7 µs of relay CPU per message out of the 25-30 the drain measures.
type jsonObject struct{ buf []byte }

// key starts the next member, named k.
func (b *jsonObject) key(k string) {
	if len(b.buf) == 0 {
		b.buf = append(b.buf, '{')
	} else {
		b.buf = append(b.buf, ',')
	}
	b.buf = appendJSONString(b.buf, k)
	b.buf = append(b.buf, ':')
}

// close ends the object and returns it as the text of a jsonb argument.
func (b *jsonObject) close() string {
	if len(b.buf) == 0 {
		return "{}"
	}
	return string(append(b.buf, '}'))
}

// appendJSONString appends s as a JSON string. Text read from PostgreSQL
// is valid UTF-8 and is written as it is; invalid bytes (only possible in
// text that did not come from the table) are replaced the way encoding/json
// replaces them, so the statement still parses (such a row cannot match).
func appendJSONString(b []byte, s string) []byte {
	if !utf8.ValidString(s) {
		q, _ := json.Marshal(s)
		return append(b, q...)
	}
	const hex = "0123456789abcdef"
	b = append(b, '"')
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c == '"' || c == '\\':
			b = append(b, '\\', c)
		case c < 0x20:
			b = append(b, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
		default:
			b = append(b, c)
		}
	}
	return append(b, '"')
}

// CleanText makes s storable as text and bounded: NUL bytes (which
// PostgreSQL text cannot hold) and invalid UTF-8 become U+FFFD, and the
// result is cut to at most max bytes on a rune boundary. A max of 0 or less
// leaves no room: the result is "".
func CleanText(s string, max int) string {
	if max <= 0 {
		return ""
	}
	s = strings.ToValidUTF8(strings.ReplaceAll(s, "\x00", "\uFFFD"), "\uFFFD")
	if len(s) <= max {
		return s
	}
	cut := max
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut]
}
