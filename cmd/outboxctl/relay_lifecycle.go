package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/forwarder/prommetrics"
	"github.com/fencedoutbox/watermill-outbox/migrations"
	"github.com/fencedoutbox/watermill-outbox/status"
)

func (a *app) relay(ctx context.Context, to, metricsAddr string, listen bool, lf logFlags, cfg forwarder.Config, sf *sinkFlags) error {
	switch to {
	case "amqp":
		a.secretSources = append(a.secretSources, sf.amqp.URI)
	case "nats":
		a.secretSources = append(a.secretSources, sf.nats.URL)
	}
	slogger, err := a.newLogger(a.stderr, lf)
	if err != nil {
		return err
	}
	newSink, ok := sinks[to]
	if !ok {
		return outbox.Errorf(CodeUsage, "outboxctl relay", "--to %q is not available; this build supports: %s", to, supportedSinks)
	}
	db, err := a.openDB(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = closeWithin(db, dbCloseTimeout) }()
	if err := migrations.Check(ctx, db); err != nil {
		return err
	}
	if listen {
		cfg.ListenURL = a.resolvedURL()
	}
	cfg = relayConfig(cfg)
	if err := cfg.Validate(); err != nil { // before anything is built from it
		return err
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	if cfg.Metrics, err = prommetrics.New(reg, prommetrics.Options{BatchSize: cfg.MaxBatchSize}); err != nil {
		return err
	}
	backlog, err := status.NewCollector(db, status.CollectorOptions{})
	if err != nil {
		return err
	}
	reg.MustRegister(backlog)

	logger := watermillLogger(slogger)
	out, classifier, err := newSink(a, sf, logger)
	if err != nil {
		return err
	}
	// The downstream is closed with a deadline (a client that cannot reach
	// its broker, stdout nobody reads): the stop must end within its grace.
	defer func() {
		if err := closeWithin(out, sinkCloseTimeout); err != nil {
			slogger.Warn("downstream not closed cleanly; every outcome was written before, so nothing is lost", "to", to, "error", a.redactString(err.Error()))
		}
	}()
	cfg.Classifier = classifier // nil: the forwarder's default
	fwd, err := forwarder.New(db, out, logger, cfg)
	if err != nil {
		return err
	}

	if metricsAddr != "" {
		ln, err := net.Listen("tcp", metricsAddr)
		if err != nil {
			return outbox.Wrap(CodeUsage, "outboxctl relay", err, "--metrics-addr cannot be served")
		}
		srv := newOpsServer(reg, &readiness{db: db, owner: fwd.Owner(), redact: a.redactString, downstream: fwd.Ready})
		go func() { _ = srv.Serve(ln) }()
		defer shutdownOps(srv)
		slogger.Info("metrics on http://"+ln.Addr().String()+"/metrics", "healthz", "/healthz", "readyz", "/readyz")
	}
	slogger.Info("relay "+fwd.Owner()+" publishing to "+to, "owner", fwd.Owner(), "to", to)
	if err := runBounded(ctx, fwd, fwd.Config().StopBound()); err != nil {
		return err
	}
	slogger.Info("relay "+fwd.Owner()+" stopped", "owner", fwd.Owner())
	return nil
}

// Deadlines of the relay's own stop, after the forwarder's (each counted by
// relayGrace).
const (
	// opsShutdownTimeout: requests in progress on the operations listener
	// may finish (a scrape, a /readyz, each bounded by its own timeout)
	// before it is closed.
	opsShutdownTimeout = 5 * time.Second
	// sinkCloseTimeout: the downstream's Close, after the listener's.
	sinkCloseTimeout = 5 * time.Second
	// dbCloseTimeout: the pool's close, last (its connections' goodbyes to
	// a server that may have stopped answering).
	dbCloseTimeout = 5 * time.Second
	// stopMargin: the signal's delivery, the process's start of the stop
	// and its exit on a busy node.
	stopMargin = 5 * time.Second
)

// CodeRelayStopTimeout: the forwarder had not stopped within its bound
// (forwarder.Config.StopBound) after SIGTERM or SIGINT; the relay exits 1
// within its grace instead of being killed, and the rows it still held
// wait for their leases.
const CodeRelayStopTimeout outbox.Code = "OUTBOXCTL_RELAY_STOP_TIMEOUT"

// relayConfig fills in what the relay sets differently from the forwarder's
// defaults: MaxBatchSize at least forwarder.DefaultMaxBatchSize.
func relayConfig(cfg forwarder.Config) forwarder.Config {
	if cfg.MaxBatchSize == 0 {
		cfg.MaxBatchSize = max(forwarder.DefaultMaxBatchSize, cfg.BatchSize)
	}
	return cfg
}

// relayGrace is the longest a stop of `outboxctl relay` may take with these
// settings, rounded up to whole seconds: the forwarder's StopBound, then
// one after the other the operations listener (when --metrics-addr is set),
// the downstream and the pool, and a margin. It refuses a configuration the
// relay would refuse.
func relayGrace(cfg forwarder.Config, metricsAddr string) (time.Duration, error) {
	cfg = relayConfig(cfg)
	if err := cfg.Validate(); err != nil {
		return 0, err
	}
	after := sinkCloseTimeout + dbCloseTimeout
	if metricsAddr != "" {
		after += opsShutdownTimeout
	}
	g := cfg.StopBound() + after + stopMargin
	return (g + time.Second - 1).Truncate(time.Second), nil
}

// runBounded runs fwd until ctx is cancelled, then waits at most bound for
// it to drain.
func runBounded(ctx context.Context, fwd *forwarder.Forwarder, bound time.Duration) error {
	done := make(chan error, 1)
	go func() { done <- fwd.Run(ctx) }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
	}
	t := time.NewTimer(bound)
	defer t.Stop()
	select {
	case err := <-done:
		return err
	case <-t.C:
		return outbox.Errorf(CodeRelayStopTimeout, "outboxctl relay",
			"the forwarder had not stopped %s after the signal (its bound with these settings: the database stopped answering?); exiting before the platform kills the relay: rows it still held stay IN_FLIGHT until their leases expire", bound)
	}
}

// shutdownOps lets requests in progress finish for opsShutdownTimeout,
// then closes the listener's connections.
func shutdownOps(srv *http.Server) {
	ctx, cancel := context.WithTimeout(context.Background(), opsShutdownTimeout)
	defer cancel()
	if srv.Shutdown(ctx) != nil {
		_ = srv.Close()
	}
}

// closeWithin closes c, waiting at most d: a Close still running then is
// left behind (the process is exiting).
func closeWithin(c io.Closer, d time.Duration) error {
	done := make(chan error, 1)
	go func() { done <- c.Close() }()
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case err := <-done:
		return err
	case <-t.C:
		return fmt.Errorf("Close did not return within %s", d)
	}
}
