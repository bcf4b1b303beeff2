package pgxadapter

import (
	"net/url"
	"strings"
)

// stripPoolParams removes pgxpool's pool_* parameters, which pgx.ParseConfig
// would otherwise send to the server as run-time parameters.
func stripPoolParams(s string) string {
	if strings.HasPrefix(s, "postgres://") || strings.HasPrefix(s, "postgresql://") {
		u, err := url.Parse(s)
		if err != nil {
			return s
		}
		q := u.Query()
		for k := range q {
			if strings.HasPrefix(k, "pool_") {
				q.Del(k)
			}
		}
		u.RawQuery = q.Encode()
		return u.String()
	}
	return stripPoolKeywords(s)
}

const connSpace = " \t\n\r\v\f" // what libpq and pgconn take for whitespace

// stripPoolKeywords removes the pool_* settings of a keyword/value connection
// string and leaves every other byte as it is. It reads the settings as
// pgconn (and libpq) do: a keyword, '=' with optional whitespace around it,
// and a value that is either single-quoted (backslash escapes anything,
// whitespace included) or runs to the next whitespace (backslash escapes the
// next byte). A string it cannot read is returned unchanged, for pgx to
// refuse with its own message.
func stripPoolKeywords(s string) string {
	var out strings.Builder
	stripped := false
	for i := 0; i < len(s); {
		start := i // a setting's span starts with the whitespace before it
		if strings.Trim(s[i:], connSpace) == "" {
			out.WriteString(s[i:])
			break
		}
		eq := strings.IndexByte(s[i:], '=')
		if eq < 0 {
			return s
		}
		eq += i
		key := strings.Trim(s[i:eq], connSpace)
		j := eq + 1
		for j < len(s) && strings.IndexByte(connSpace, s[j]) >= 0 {
			j++
		}
		switch {
		case j == len(s):
		case s[j] == '\'':
			j++
			for j < len(s) && s[j] != '\'' {
				if s[j] == '\\' {
					j++
				}
				j++
			}
			if j >= len(s) {
				return s // unterminated quoted value
			}
			j++ // the closing quote
		default:
			for j < len(s) && strings.IndexByte(connSpace, s[j]) < 0 {
				if s[j] == '\\' {
					j++
				}
				j++
			}
			j = min(j, len(s)) // a trailing backslash
		}
		if strings.HasPrefix(key, "pool_") {
			stripped = true
		} else {
			out.WriteString(s[start:j])
		}
		i = j
	}
	if !stripped {
		return s
	}
	return out.String()
}
