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
	var kept []string
	for _, f := range strings.Fields(s) {
		if !strings.HasPrefix(f, "pool_") {
			kept = append(kept, f)
		}
	}
	return strings.Join(kept, " ")
}
