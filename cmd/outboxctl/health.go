package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/fencedoutbox/watermill-outbox/migrations"
	"github.com/fencedoutbox/watermill-outbox/relaymode"
)

// Bounds of the relay's operations listener (/metrics, /healthz, /readyz).
const (
	opsMaxInFlight  = 8 // requests served at once; more get 503 at once
	opsReadTimeout  = 10 * time.Second
	opsWriteTimeout = 30 * time.Second
	opsIdleTimeout  = 60 * time.Second
	readyTimeout    = 5 * time.Second // bound on one /readyz's database checks
)

// newOpsServer serves /metrics from reg, /healthz and /readyz, with read,
// write and idle timeouts and at most opsMaxInFlight requests at once.
func newOpsServer(reg *prometheus.Registry, ready *readiness) *http.Server {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		_, _ = fmt.Fprintln(w, "ok")
	})
	mux.Handle("/readyz", ready)
	return &http.Server{
		Handler:           limitInFlight(mux, opsMaxInFlight),
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       opsReadTimeout,
		WriteTimeout:      opsWriteTimeout,
		IdleTimeout:       opsIdleTimeout,
	}
}

func limitInFlight(h http.Handler, n int) http.Handler {
	sem := make(chan struct{}, n)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case sem <- struct{}{}:
			defer func() { <-sem }()
			h.ServeHTTP(w, r)
		default:
			http.Error(w, "too many requests in flight", http.StatusServiceUnavailable)
		}
	})
}

// readiness is /readyz: the relay can do its work now.
type readiness struct {
	db     *sql.DB
	owner  string
	redact func(string) string
	// downstream, when set, reports whether the relay can deliver anything
	// (forwarder.Ready: not while every destination's breaker is open).
	downstream func() error
}

// check is one readiness condition and its outcome.
type check struct {
	Name  string `json:"name"`
	OK    bool   `json:"ok"`
	Error string `json:"error,omitempty"`
}

// Checks runs the readiness conditions in order, stopping at the first that
// fails (the later ones need it): the database answers, the schema is
// migrated, the relay mode is POLLING, this relay's heartbeat is live, and
// not every destination it publishes to has its breaker open.
func (r *readiness) Checks(ctx context.Context) []check {
	var out []check
	add := func(name string, err error) bool {
		c := check{Name: name, OK: err == nil}
		if err != nil {
			c.Error = r.redact(err.Error())
		}
		out = append(out, c)
		return err == nil
	}
	if !add("database", r.db.PingContext(ctx)) {
		return out
	}
	if !add("schema", migrations.Check(ctx, r.db)) {
		return out
	}
	mode, err := relaymode.CurrentMode(ctx, r.db)
	if err == nil && mode != relaymode.ModePolling {
		err = fmt.Errorf("relay mode is %s: a polling relay does not run (outboxctl debezium disable switches back)", mode)
	}
	if !add("relay_mode", err) {
		return out
	}
	live, err := relaymode.LiveRelays(ctx, r.db, time.Time{})
	if err == nil && !slices.ContainsFunc(live, func(h relaymode.Heartbeat) bool { return h.Owner == r.owner }) {
		err = fmt.Errorf("no live heartbeat of relay %s (starting, stopping, or its heartbeats fail)", r.owner)
	}
	if !add("heartbeat", err) || r.downstream == nil {
		return out
	}
	add("downstream", r.downstream())
	return out
}

func (r *readiness) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	ctx, cancel := context.WithTimeout(req.Context(), readyTimeout)
	defer cancel()
	checks := r.Checks(ctx)
	ready := !slices.ContainsFunc(checks, func(c check) bool { return !c.OK })
	w.Header().Set("Content-Type", "application/json")
	if !ready {
		w.WriteHeader(http.StatusServiceUnavailable)
	}
	_ = json.NewEncoder(w).Encode(map[string]any{"ready": ready, "owner": r.owner, "checks": checks})
}
