package publisher

import (
	"database/sql"
	"database/sql/driver"
	"strings"
)

// text maps "" to NULL: the envelope never stores an absent value as an
// empty string.
func text(s string) sql.NullString { return sql.NullString{String: s, Valid: s != ""} }

// textArray is a one-dimensional PostgreSQL array literal whose elements may
// be NULL (pq.StringArray cannot carry NULL). The statement casts it to the
// column's type (text[], jsonb[], timestamptz[], bigint[]).
type textArray []sql.NullString

// Value encodes the array literal: NULL unquoted, every other element
// double-quoted with backslash and double quote escaped, which is all the
// array input syntax requires. Values never contain NUL (the envelope refuses
// it before this point).
func (a textArray) Value() (driver.Value, error) {
	var b strings.Builder
	b.WriteByte('{')
	for i, e := range a {
		if i > 0 {
			b.WriteByte(',')
		}
		if !e.Valid {
			b.WriteString("NULL")
			continue
		}
		b.WriteByte('"')
		for j := 0; j < len(e.String); j++ {
			c := e.String[j]
			if c == '"' || c == '\\' {
				b.WriteByte('\\')
			}
			b.WriteByte(c)
		}
		b.WriteByte('"')
	}
	b.WriteByte('}')
	return b.String(), nil
}
