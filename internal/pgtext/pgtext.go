// Package pgtext holds the module's rules for text it writes to PostgreSQL
// and prints: which strings a text column can hold, and which characters
// are control characters. The publisher, the envelope and the forwarder's
// configuration check their text with it, so the rules are the same
// everywhere.
package pgtext

import (
	"strings"
	"unicode/utf8"
)

// Unstorable says why PostgreSQL text cannot hold s, as a phrase that
// follows the value's name ("contains a NUL byte, which PostgreSQL text
// cannot store", "is not valid UTF-8"), or "" when it can.
func Unstorable(s string) string {
	if strings.IndexByte(s, 0) >= 0 {
		return "contains a NUL byte, which PostgreSQL text cannot store"
	}
	if !utf8.ValidString(s) {
		return "is not valid UTF-8"
	}
	return ""
}

// ControlAt returns the byte index of the first control character of s
// (C0, DEL or C1) other than NUL, which Unstorable reports, or -1.
func ControlAt(s string) int {
	for i, r := range s {
		if r != 0 && (r < 0x20 || (r >= 0x7f && r <= 0x9f)) {
			return i
		}
	}
	return -1
}
