package main

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os/signal"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/spf13/cobra"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/forwarder/prommetrics"
	"github.com/fencedoutbox/watermill-outbox/migrations"
	"github.com/fencedoutbox/watermill-outbox/status"
	"github.com/fencedoutbox/watermill-outbox/transport/amqp"
	"github.com/fencedoutbox/watermill-outbox/transport/googlecloud"
	"github.com/fencedoutbox/watermill-outbox/transport/kafka"
	"github.com/fencedoutbox/watermill-outbox/transport/nats"
)

// sinkFlags are the transports' connection flags.
type sinkFlags struct {
	pubsub googlecloud.Config
	// kafkaBrokers is the comma-separated --kafka-brokers; split by
	// kafkaConfig so that an empty or malformed list reaches kafka.Config's
	// own validation and its typed refusal.
	kafkaBrokers string
	kafka        kafka.Config
	amqp         amqp.Config
	nats         nats.Config
}

// kafkaConfig is the kafka.Config of the flags. An empty flag is an empty
// list (not one empty address), and blanks around commas are ignored, so
// "a:9092, b:9092" works and "a:9092,,b:9092" is refused.
func (f *sinkFlags) kafkaConfig() kafka.Config {
	c := f.kafka
	c.Brokers = nil
	if strings.TrimSpace(f.kafkaBrokers) != "" {
		for _, b := range strings.Split(f.kafkaBrokers, ",") {
			c.Brokers = append(c.Brokers, strings.TrimSpace(b))
		}
	}
	return c
}

// sinks are the downstreams `relay --to` accepts, each with the forwarder
// classifier of its transport. Only transports whose packages exist in this
// module are listed; none is a stub.
var sinks = map[string]func(a *app, f *sinkFlags, logger watermill.LoggerAdapter) (message.Publisher, forwarder.Classifier, error){
	"log": func(a *app, _ *sinkFlags, _ watermill.LoggerAdapter) (message.Publisher, forwarder.Classifier, error) {
		return newLogPublisher(a.stdout), nil, nil
	},
	// Pub/Sub; the client honours PUBSUB_EMULATOR_HOST for an emulator.
	"pubsub": func(_ *app, f *sinkFlags, logger watermill.LoggerAdapter) (message.Publisher, forwarder.Classifier, error) {
		p, err := googlecloud.NewPublisher(f.pubsub, logger)
		return p, googlecloud.Classify, err
	},
	"kafka": func(_ *app, f *sinkFlags, logger watermill.LoggerAdapter) (message.Publisher, forwarder.Classifier, error) {
		c := f.kafkaConfig()
		if err := c.Validate(); err != nil { // empty list or address: kafka.Config's refusal
			return nil, nil, err
		}
		if err := checkKafkaBrokers(c.Brokers); err != nil {
			return nil, nil, err
		}
		p, err := kafka.NewPublisher(c, logger)
		return p, kafka.Classify, err
	},
	"amqp": func(_ *app, f *sinkFlags, logger watermill.LoggerAdapter) (message.Publisher, forwarder.Classifier, error) {
		if f.amqp.URI != "" { // empty: amqp.Config's own refusal below
			// Without this a malformed URI would surface as a dial failure
			// (exit 1) although the command line is what must change.
			if _, err := amqp091.ParseURI(f.amqp.URI); err != nil {
				return nil, nil, outbox.Wrap(outbox.CodeInvalidConfig, "outboxctl relay", err, "--amqp-url is not an AMQP URI")
			}
		}
		p, err := amqp.NewPublisher(f.amqp, logger)
		return p, amqp.Classify, err
	},
	"nats": func(_ *app, f *sinkFlags, logger watermill.LoggerAdapter) (message.Publisher, forwarder.Classifier, error) {
		if f.nats.URL != "" { // empty: nats.Config's own refusal below
			if err := checkNATSURL(f.nats.URL); err != nil {
				return nil, nil, err
			}
		}
		p, err := nats.NewPublisher(f.nats, logger)
		return p, nats.Classify, err
	},
}

// checkKafkaBrokers refuses a broker that is not host:port with a port in
// 1-65535 (OUTBOX_INVALID_CONFIG): sarama would only fail at dial time,
// after its retries, as a connection error (exit 1).
func checkKafkaBrokers(brokers []string) error {
	for _, b := range brokers {
		host, port, err := net.SplitHostPort(b)
		if err == nil && host == "" {
			err = errors.New("no host")
		}
		if err == nil {
			var n uint64
			if n, err = strconv.ParseUint(port, 10, 16); err == nil && n == 0 {
				err = errors.New("port 0")
			}
		}
		if err != nil {
			return outbox.Errorf(outbox.CodeInvalidConfig, "outboxctl relay", "--kafka-brokers: %q is not host:port with a port in 1-65535", b)
		}
	}
	return nil
}

// checkNATSURL parses the comma-separated --nats-url as nats.go does (a
// server without "://" gets nats://) and refuses, with
// OUTBOX_INVALID_CONFIG, one that does not parse or names no host: the
// client would fail at connect (exit 1) although the setting must change.
// Neither the URL nor the parser's message is quoted: both may carry the
// password.
func checkNATSURL(list string) error {
	n := 0
	for i, s := range strings.Split(list, ",") {
		s = strings.TrimSpace(s)
		if s == "" {
			continue // nats.go skips empty entries
		}
		n++
		if !strings.Contains(s, "://") {
			s = "nats://" + s
		}
		u, err := url.Parse(s)
		if err != nil || u.Hostname() == "" {
			return outbox.Errorf(outbox.CodeInvalidConfig, "outboxctl relay",
				"--nats-url: server %d does not parse as a URL with a host: percent-encode reserved characters of the user and password (%% as %%25, @ as %%40, : as %%3A, / as %%2F); it is not shown, as it may hold a password", i+1)
		}
	}
	if n == 0 {
		return outbox.Errorf(outbox.CodeInvalidConfig, "outboxctl relay", "--nats-url lists no server, e.g. nats://127.0.0.1:4222")
	}
	return nil
}

const supportedSinks = "log, pubsub, kafka, amqp, nats"

func (a *app) relayCommand() *cobra.Command {
	var (
		to          string
		metricsAddr string
		listen      bool
		lf          logFlags
		cfg         forwarder.Config
		sf          sinkFlags
		printGrace  bool
	)
	cmd := &cobra.Command{
		Use:   "relay",
		Short: "Run a standalone forwarder that publishes the outbox to a downstream (--to log|pubsub|kafka|amqp|nats)",
		Long: `Run the fenced forwarder as a process of its own until SIGINT or SIGTERM,
which drain the pass in progress (publishes already started finish or are
recorded AMBIGUOUS; nothing is left IN_FLIGHT under this relay's name).

Downstreams (--to), each classifying publish errors with its transport's
Classify (confirmed, rejected = parked FAILED, ambiguous = retried):

  log     each message as one JSON line on stdout
          ({"topic","uuid","metadata","payload_base64","payload_text"}), confirmed
          once written.
  pubsub  Google Cloud Pub/Sub: --pubsub-project (the client honours
          PUBSUB_EMULATOR_HOST).
  kafka   Apache Kafka: --kafka-brokers host:port,host:port. The record key is
          msg.partition_key, else the UUID; acks from all in-sync replicas.
  amqp    RabbitMQ: --amqp-url. The topic is a durable fanout exchange;
          publisher confirms; bind consumer queues before relaying (a fanout
          exchange without queues confirms and drops).
  nats    NATS JetStream: --nats-url. The topic is the subject, the UUID the
          Nats-Msg-Id; a stream must capture the subject.

A missing topic or exchange parks the row FAILED (fix it, then redrive)
unless --pubsub-create-topics, --kafka-auto-create-topics or
--amqp-create-exchanges. A NATS subject no stream captures is unavailable,
not a rejection: the row stays PENDING with no attempt spent and the
destination's breaker opens, holding its backlog until a stream answers
(create the stream, or set --nats-create-streams). An empty, malformed or
refused sink setting (e.g. --kafka-brokers "", --kafka-brokers nohostport,
an --amqp-url or --nats-url that does not parse) is a usage error, refused
before any dial: OUTBOX_INVALID_CONFIG, exit 2.

Every flag can also be set from the environment: OUTBOX_ and the flag's name
upper-cased with '-' as '_' (--max-attempts is OUTBOX_MAX_ATTEMPTS, --to is
OUTBOX_TO), or from the file OUTBOX_<NAME>_FILE names (a mounted secret); a
flag on the command line wins, then the variable, then its file. Secrets
(--amqp-url, --nats-url, the database URL) are best given this way: flags
show in ps.

--metrics-addr serves, on one listener (bind it to a pod or loopback
address, e.g. 127.0.0.1:9464):
  /metrics  the forwarder's counters and histograms and the backlog gauges
  /healthz  200 while the process serves (liveness)
  /readyz   200 when the database answers, the schema is migrated, the relay
            mode is POLLING, this relay's heartbeat is fresh and not every
            destination's breaker is open; else 503 with the failing check
            (readiness)

Logs go to stderr as text (default) or JSON lines (--log-format json), at
--log-level debug|info|warn|error; secrets are masked and control
characters escaped in every field.

The relay refuses to start with RELAY_MODE_CONFLICT (exit 3) when the
database's relay mode is CDC, and with OUTBOX_SCHEMA_NOT_MIGRATED (exit 2)
when the search_path has no migrated schema. --timeout does not apply: the
relay runs until it is signalled. On SIGTERM it stops claiming, lets
publishes in flight finish for up to --drain-timeout, writes their outcomes,
removes its heartbeat, closes the downstream and the metrics listener and
exits 0. Every step has a deadline, so the stop's length is known from the
settings: --print-grace prints it in seconds (with the same flags and
OUTBOX_* variables as the relay; nothing is opened) and the platform must
give at least that (Kubernetes terminationGracePeriodSeconds, systemd
TimeoutStopSec). It is the forwarder's bound (--drain-timeout + 4 x
--db-timeout, or --heartbeat-interval when longer, + --db-timeout for the
heartbeat's removal) + 5s each to close the metrics listener (with
--metrics-addr), the downstream and the database pool + 5s of margin. A stop the forwarder has not finished within its
bound (a database that stopped answering altogether) exits 1 with
OUTBOXCTL_RELAY_STOP_TIMEOUT, its rows waiting for their leases, rather
than being killed by the platform.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := bindEnv(cmd, a.getenv); err != nil {
				return runError{err}
			}
			if printGrace {
				g, err := relayGrace(cfg, metricsAddr)
				if err != nil {
					return runError{err}
				}
				_, err = fmt.Fprintln(a.stdout, int64(g/time.Second))
				return err
			}
			// No --timeout: a relay runs until SIGINT/SIGTERM.
			ctx, stop := signal.NotifyContext(cmd.Context(), syscall.SIGINT, syscall.SIGTERM)
			defer stop()
			if err := a.relay(ctx, to, metricsAddr, listen, lf, cfg, &sf); err != nil {
				return runError{err}
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&to, "to", "", "downstream: "+supportedSinks)
	f.StringVar(&sf.pubsub.ProjectID, "pubsub-project", "", "pubsub: Google Cloud project (PUBSUB_EMULATOR_HOST selects an emulator)")
	f.BoolVar(&sf.pubsub.CreateMissingTopics, "pubsub-create-topics", false, "pubsub: create missing topics (default: a missing topic parks the row FAILED)")
	f.BoolVar(&sf.pubsub.EnableMessageOrdering, "pubsub-ordering", false, "pubsub: send msg.partition_key as the ordering key")
	f.StringVar(&sf.kafkaBrokers, "kafka-brokers", "", "kafka: bootstrap brokers, comma separated (host:port,host:port)")
	f.BoolVar(&sf.kafka.AllowAutoTopicCreation, "kafka-auto-create-topics", false, "kafka: let the broker auto-create a missing topic if it allows it (default: a missing topic parks the row FAILED)")
	f.StringVar(&sf.amqp.URI, "amqp-url", "amqp://guest:guest@127.0.0.1:5672/", "amqp: RabbitMQ URI")
	f.BoolVar(&sf.amqp.CreateMissingExchanges, "amqp-create-exchanges", false, "amqp: declare missing exchanges (default: a missing exchange parks the row FAILED)")
	f.StringVar(&sf.nats.URL, "nats-url", "nats://127.0.0.1:4222", "nats: NATS server URL (JetStream enabled)")
	f.BoolVar(&sf.nats.AutoProvision, "nats-create-streams", false, "nats: create a stream for a subject no stream captures (default: such a row stays PENDING, no attempt spent, and the destination's breaker opens until a stream answers)")
	f.StringVar(&metricsAddr, "metrics-addr", "", "serve /metrics, /healthz and /readyz on this address (e.g. 127.0.0.1:9464; empty = off)")
	f.StringVar(&lf.format, "log-format", "text", "log format on stderr: text or json")
	f.StringVar(&lf.level, "log-level", "info", "least log level: debug, info, warn or error")
	f.BoolVar(&listen, "listen", false, "LISTEN for the publisher's NOTIFY wake-ups on the same database")
	f.IntVar(&cfg.BatchSize, "batch-size", forwarder.DefaultBatchSize, "rows claimed per pass while the relay keeps up")
	f.IntVar(&cfg.MaxBatchSize, "max-batch-size", 0, "rows a pass may claim while the relay is behind (0 = 1000, or --batch-size when larger; equal to --batch-size: a fixed size)")
	f.IntVar(&cfg.Concurrency, "concurrency", forwarder.DefaultConcurrency, "publishes in flight per pass")
	f.IntVar(&cfg.MaxAttempts, "max-attempts", forwarder.DefaultMaxAttempts, "attempt budget per row before it is parked EXHAUSTED")
	f.DurationVar(&cfg.LeaseDuration, "lease", forwarder.DefaultLeaseDuration, "lease per claimed row (>= 2 x --publish-timeout)")
	f.DurationVar(&cfg.PublishTimeout, "publish-timeout", forwarder.DefaultPublishTimeout, "bound on one downstream publish")
	f.DurationVar(&cfg.DrainTimeout, "drain-timeout", 0, "on SIGTERM, how long publishes in flight may finish (0 = --publish-timeout)")
	f.Int64Var(&cfg.MaxBatchBytes, "max-batch-bytes", forwarder.DefaultMaxBatchBytes, "payload and header bytes one claim takes at most (a single larger row still goes alone)")
	f.DurationVar(&cfg.DBTimeout, "db-timeout", 0, "bound on each claim and outcome statement (0 = 15s, or half of --lease when shorter; at most half of --lease)")
	f.IntVar(&cfg.MaxAbandoned, "max-abandoned", 0, "publishes left running past --publish-timeout before the relay stops claiming (0 = 2 x --concurrency)")
	f.DurationVar(&cfg.HeartbeatInterval, "heartbeat-interval", forwarder.DefaultHeartbeatInterval, "relay heartbeat period; the heartbeat lives 3 periods")
	f.DurationVar(&cfg.PollInterval, "poll-interval", forwarder.DefaultPollInterval, "wait after a pass that found some work")
	f.DurationVar(&cfg.MaxPollInterval, "max-poll-interval", forwarder.DefaultMaxPollInterval, "cap of the idle backoff")
	f.StringVar(&cfg.Owner, "owner", "", "relay owner id in leases and heartbeats (default host-pid-random)")
	f.StringVar(&cfg.Producer, "producer", "", "msg.producer restored on rows that carry none")
	f.BoolVar(&printGrace, "print-grace", false, "print the seconds a stop may take with these settings (the grace period to give the relay) and exit")
	envFlags(cmd)
	return cmd
}

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

// logPublisher is the `--to log` downstream: one JSON line per message on
// stdout, confirmed as soon as the line is written.
//
// A write to a stdout nobody reads blocks for ever (a pipe is not pollable,
// so it has no deadline). The forwarder leaves such a publish behind after
// PublishTimeout and records it AMBIGUOUS; the publishes queued behind it
// give up when their message's context ends instead of waiting for it, and
// Close waits for it only sinkCloseTimeout.
type logPublisher struct {
	turn   chan struct{} // one write at a time: lines must not interleave
	out    io.Writer
	closed atomic.Bool
}

func newLogPublisher(out io.Writer) *logPublisher {
	return &logPublisher{out: out, turn: make(chan struct{}, 1)}
}

type logLine struct {
	Topic         string            `json:"topic"`
	UUID          string            `json:"uuid"`
	Metadata      map[string]string `json:"metadata"`
	PayloadBase64 string            `json:"payload_base64"`
	PayloadText   *string           `json:"payload_text,omitempty"`
}

var errLogPublisherClosed = errors.New("log publisher closed")

func (p *logPublisher) Publish(topic string, msgs ...*message.Message) error {
	if p.closed.Load() {
		return errLogPublisherClosed
	}
	var done <-chan struct{} // the first message's context: the forwarder's publish timeout
	if len(msgs) > 0 {
		done = msgs[0].Context().Done()
	}
	select {
	case p.turn <- struct{}{}:
	case <-done:
		return fmt.Errorf("stdout is busy with an earlier line (is it read?): %w", msgs[0].Context().Err())
	}
	defer func() { <-p.turn }()
	if p.closed.Load() {
		return errLogPublisherClosed
	}
	for _, m := range msgs {
		l := logLine{Topic: topic, UUID: m.UUID, Metadata: map[string]string(m.Metadata), PayloadBase64: base64.StdEncoding.EncodeToString(m.Payload)}
		if l.Metadata == nil {
			l.Metadata = map[string]string{}
		}
		if utf8.Valid(m.Payload) {
			s := string(m.Payload)
			l.PayloadText = &s
		}
		b, err := json.Marshal(l)
		if err != nil {
			return err
		}
		if _, err := p.out.Write(append(b, '\n')); err != nil {
			return err
		}
	}
	return nil
}

// Close refuses further publishes and waits up to sinkCloseTimeout for a
// line being written; a write blocked longer (stdout not read) is left
// behind and reported.
func (p *logPublisher) Close() error {
	p.closed.Store(true)
	t := time.NewTimer(sinkCloseTimeout)
	defer t.Stop()
	select {
	case p.turn <- struct{}{}:
		<-p.turn
		return nil
	case <-t.C:
		return errors.New("a line to stdout was still being written (stdout is not read); its message was recorded AMBIGUOUS and is published again")
	}
}
