package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
)

// /readyz runs its five checks in order (database, schema, relay_mode,
// heartbeat, downstream) and stops at the first that fails: 200 only when all
// pass, 503 with the checks run so far otherwise. The README lists the same
// five.
func TestReadinessChecksInOrder(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	ctx := context.Background()
	var downstream error
	r := &readiness{db: s.DB, owner: "ready-1", redact: func(s string) string { return s },
		downstream: func() error { return downstream }}
	serve := func() (int, []check) {
		rec := httptest.NewRecorder()
		r.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/readyz", nil))
		var body struct {
			Ready  bool    `json:"ready"`
			Checks []check `json:"checks"`
		}
		require.NoError(t, json.Unmarshal(rec.Body.Bytes(), &body), rec.Body.String())
		require.Equal(t, rec.Code == http.StatusOK, body.Ready)
		return rec.Code, body.Checks
	}
	names := func(cs []check) (out []string) {
		for _, c := range cs {
			out = append(out, c.Name)
		}
		return out
	}

	code, checks := serve()
	require.Equal(t, http.StatusServiceUnavailable, code)
	require.Equal(t, []string{"database", "schema", "relay_mode", "heartbeat"}, names(checks))
	require.False(t, checks[3].OK, "no heartbeat of ready-1 yet")

	require.NoError(t, relaymode.Beat(ctx, s.DB, "ready-1", time.Hour))
	code, checks = serve()
	require.Equal(t, http.StatusOK, code, checks)
	require.Equal(t, []string{"database", "schema", "relay_mode", "heartbeat", "downstream"}, names(checks))

	downstream = fmt.Errorf("every destination's breaker is open: %w", forwarder.ErrDownstreamUnavailable)
	code, checks = serve()
	require.Equal(t, http.StatusServiceUnavailable, code)
	require.Equal(t, "downstream", checks[4].Name)
	require.False(t, checks[4].OK)
	require.Contains(t, checks[4].Error, "every destination's breaker is open")

	// The mode switched to CDC: relay_mode fails, and the later checks do not run.
	_, err := s.DB.Exec(`UPDATE messaging_relay_mode SET mode = 'CDC'`)
	require.NoError(t, err)
	code, checks = serve()
	require.Equal(t, http.StatusServiceUnavailable, code)
	require.Equal(t, []string{"database", "schema", "relay_mode"}, names(checks))
	require.False(t, checks[2].OK)
}
