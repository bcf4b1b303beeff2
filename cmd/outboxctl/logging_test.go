package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
)

// Every log line of the relay is redacted (message, fields, errors) and
// escapes control characters, in both formats; --log-level filters.
func TestRelayLoggerRedactsAndEscapes(t *testing.T) {
	t.Parallel()
	dsn := "postgres://relay:" + secret + "@db.internal:5432/app"
	a := &app{databaseURL: dsn, getenv: func(string) string { return "" },
		secretSources: []string{"amqp://guest:Br0kerPW@rabbit:5672/"}}
	for _, format := range []string{"text", "json"} {
		var buf bytes.Buffer
		l, err := a.newLogger(&buf, logFlags{format: format, level: "info"})
		require.NoError(t, err)
		wl := watermillLogger(l)
		wl.Error("Outbox LISTEN failed for "+dsn, errors.New(`dial "`+dsn+`": refused; amqp://guest:Br0kerPW@rabbit`), watermill.LogFields{
			"listen_url":  dsn,
			"destination": "orders\nmsg=\"forged\" owner=attacker\x1b[2J",
			"kv":          "host=db password=" + secret + " user=x",
		})
		wl.Debug("not at info", nil)
		out := buf.String()
		require.NotContains(t, out, secret, format)
		require.NotContains(t, out, "Br0kerPW", format)
		require.NotContains(t, out, "\x1b", format)
		require.Equal(t, 1, strings.Count(out, "\n"), "one event, one line (%s):\n%s", format, out)
		require.NotContains(t, out, "not at info")
		if format == "json" {
			var m map[string]any
			require.NoError(t, json.Unmarshal([]byte(out), &m))
			require.Equal(t, "orders\nmsg=\"forged\" owner=attacker\x1b[2J", m["destination"])
		} else {
			require.Contains(t, out, `destination="orders\nmsg=\"forged\" owner=attacker\x1b[2J"`)
		}
	}
}

// The operations listener serves a bounded number of requests at once.
func TestOpsListenerLimitsInFlight(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	entered := make(chan struct{}, 1)
	h := limitInFlight(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		entered <- struct{}{}
		<-release
	}), 1)
	srv := httptest.NewServer(h)
	defer srv.Close()
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		resp, err := http.Get(srv.URL)
		if err == nil {
			_ = resp.Body.Close()
		}
	}()
	<-entered
	resp, err := http.Get(srv.URL)
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())
	require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
	close(release)
	wg.Wait()

	s := newOpsServer(prometheus.NewRegistry(), nil)
	require.Positive(t, s.ReadTimeout)
	require.Positive(t, s.WriteTimeout)
	require.Positive(t, s.IdleTimeout)
	require.Positive(t, s.ReadHeaderTimeout)
}
