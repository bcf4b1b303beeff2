// Package redact removes credentials from connection strings and from error
// texts that may quote them, so that no log line, error message or JSON
// output of this project ever carries a password.
//
// It understands the two forms PostgreSQL and the brokers use: URLs
// (scheme://user:password@host/...?password=...) and libpq key=value strings
// (password=... or password='...'). It never parses with net/url first:
// net/url's own errors quote the whole input, password included.
package redact

import (
	"errors"
	"regexp"
	"strings"
)

// Mask replaces every secret.
const Mask = "xxxxx"

var (
	// scheme://user:secret@ — the secret runs to the last '@' before the
	// host part; a raw '@' or '%' in a generated password is common.
	urlUserinfo = regexp.MustCompile(`([a-zA-Z][a-zA-Z0-9+.\-]*://[^:/?#@\s]*:)([^\s]*)@`)
	// password=secret, password='sec ret', sslpassword=..., in key=value
	// strings and in URL query strings.
	kvSecret = regexp.MustCompile(`(?i)\b((?:ssl)?pass(?:word)?|secret|token)(\s*=\s*)('(?:[^'\\]|\\.)*'|[^\s&'"]+)`)
)

// String returns s with every password in it masked. Safe on any input,
// including malformed URLs.
func String(s string) string {
	if s == "" {
		return s
	}
	s = urlUserinfo.ReplaceAllStringFunc(s, func(m string) string {
		sub := urlUserinfo.FindStringSubmatch(m)
		// sub[2] may contain further '@' (greedy to the last one): all of
		// it is the secret.
		return sub[1] + Mask + "@"
	})
	return kvSecret.ReplaceAllString(s, "${1}${2}"+Mask)
}

// Secrets returns the literal secrets found in dsn (the URL password, raw
// and decoded, and any password= value), for scrubbing texts that quote
// them in other forms.
func Secrets(dsn string) []string {
	var out []string
	if m := urlUserinfo.FindStringSubmatch(dsn); m != nil && m[2] != "" {
		out = append(out, m[2])
		if dec, err := unescape(m[2]); err == nil && dec != m[2] {
			out = append(out, dec)
		}
	}
	for _, m := range kvSecret.FindAllStringSubmatch(dsn, -1) {
		v := strings.Trim(m[3], "'")
		if v != "" {
			out = append(out, v)
		}
	}
	return out
}

// Error wraps err so that its text has every secret of dsn (and any
// URL-shaped or key=value secret) masked. errors.Is and errors.As still see
// the original chain. Nil stays nil.
func Error(err error, dsn string) error {
	if err == nil {
		return nil
	}
	return &redacted{err: err, secrets: Secrets(dsn)}
}

type redacted struct {
	err     error
	secrets []string
}

func (r *redacted) Error() string {
	s := r.err.Error()
	for _, sec := range r.secrets {
		if len(sec) >= 3 {
			s = strings.ReplaceAll(s, sec, Mask)
		}
	}
	return String(s)
}

func (r *redacted) Unwrap() error { return r.err }

var errBadEscape = errors.New("bad escape")

// unescape decodes %XX sequences, refusing malformed ones.
func unescape(s string) (string, error) {
	if !strings.Contains(s, "%") {
		return s, nil
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] != '%' {
			b.WriteByte(s[i])
			continue
		}
		if i+2 >= len(s) || !isHex(s[i+1]) || !isHex(s[i+2]) {
			return "", errBadEscape
		}
		b.WriteByte(unhex(s[i+1])<<4 | unhex(s[i+2]))
		i += 2
	}
	return b.String(), nil
}

func isHex(c byte) bool {
	return '0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F'
}

func unhex(c byte) byte {
	switch {
	case '0' <= c && c <= '9':
		return c - '0'
	case 'a' <= c && c <= 'f':
		return c - 'a' + 10
	}
	return c - 'A' + 10
}
