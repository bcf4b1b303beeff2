package main

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/spf13/cobra"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/forwarder/prommetrics"
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
		return &logPublisher{out: a.stdout}, nil, nil
	},
	// Pub/Sub; the client honours PUBSUB_EMULATOR_HOST for an emulator.
	"pubsub": func(_ *app, f *sinkFlags, logger watermill.LoggerAdapter) (message.Publisher, forwarder.Classifier, error) {
		p, err := googlecloud.NewPublisher(f.pubsub, logger)
		return p, googlecloud.Classify, err
	},
	"kafka": func(_ *app, f *sinkFlags, logger watermill.LoggerAdapter) (message.Publisher, forwarder.Classifier, error) {
		p, err := kafka.NewPublisher(f.kafkaConfig(), logger)
		return p, kafka.Classify, err
	},
	"amqp": func(_ *app, f *sinkFlags, logger watermill.LoggerAdapter) (message.Publisher, forwarder.Classifier, error) {
		if f.amqp.URI != "" { // empty: amqp.Config's own refusal below
			// Without this a malformed URI would surface as a dial failure
			// (exit 1) although the command line is what must change.
			if _, err := amqp091.ParseURI(f.amqp.URI); err != nil {
				return nil, nil, outbox.Wrap(CodeUsage, "outboxctl relay", err, "--amqp-url is not an AMQP URI")
			}
		}
		p, err := amqp.NewPublisher(f.amqp, logger)
		return p, amqp.Classify, err
	},
	"nats": func(_ *app, f *sinkFlags, logger watermill.LoggerAdapter) (message.Publisher, forwarder.Classifier, error) {
		p, err := nats.NewPublisher(f.nats, logger)
		return p, nats.Classify, err
	},
}

const supportedSinks = "log, pubsub, kafka, amqp, nats"

func (a *app) relayCommand() *cobra.Command {
	var (
		to          string
		metricsAddr string
		listen      bool
		cfg         forwarder.Config
		sf          sinkFlags
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

A missing topic, exchange or stream parks the row FAILED (fix it, then
redrive) unless --pubsub-create-topics, --kafka-auto-create-topics,
--amqp-create-exchanges or --nats-create-streams. An empty or refused sink
setting (e.g. --kafka-brokers "") is a usage error: OUTBOX_INVALID_CONFIG,
exit 2.

--metrics-addr serves /metrics (the forwarder's counters and histograms and
the backlog gauges of package status). The relay refuses to start with
RELAY_MODE_CONFLICT (exit 3) when the database's relay mode is CDC.
--timeout does not apply: the relay runs until it is signalled.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			// No --timeout: a relay runs until SIGINT/SIGTERM.
			ctx, stop := signal.NotifyContext(cmd.Context(), syscall.SIGINT, syscall.SIGTERM)
			defer stop()
			if err := a.relay(ctx, to, metricsAddr, listen, cfg, &sf); err != nil {
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
	f.BoolVar(&sf.nats.AutoProvision, "nats-create-streams", false, "nats: create a stream for a subject no stream captures (default: such a row is parked FAILED)")
	f.StringVar(&metricsAddr, "metrics-addr", "", "serve Prometheus /metrics on this address (e.g. :9464; empty = off)")
	f.BoolVar(&listen, "listen", false, "LISTEN for the publisher's NOTIFY wake-ups on the same database")
	f.IntVar(&cfg.BatchSize, "batch-size", forwarder.DefaultBatchSize, "rows claimed per pass")
	f.IntVar(&cfg.Concurrency, "concurrency", forwarder.DefaultConcurrency, "publishes in flight per pass")
	f.IntVar(&cfg.MaxAttempts, "max-attempts", forwarder.DefaultMaxAttempts, "attempt budget per row before it is parked EXHAUSTED")
	f.DurationVar(&cfg.LeaseDuration, "lease", forwarder.DefaultLeaseDuration, "lease per claimed row (>= 2 x --publish-timeout)")
	f.DurationVar(&cfg.PublishTimeout, "publish-timeout", forwarder.DefaultPublishTimeout, "bound on one downstream publish")
	f.DurationVar(&cfg.PollInterval, "poll-interval", forwarder.DefaultPollInterval, "wait after a pass that found some work")
	f.DurationVar(&cfg.MaxPollInterval, "max-poll-interval", forwarder.DefaultMaxPollInterval, "cap of the idle backoff")
	f.StringVar(&cfg.Owner, "owner", "", "relay owner id in leases and heartbeats (default host-pid-random)")
	f.StringVar(&cfg.Producer, "producer", "", "msg.producer restored on rows that carry none")
	return cmd
}

func (a *app) relay(ctx context.Context, to, metricsAddr string, listen bool, cfg forwarder.Config, sf *sinkFlags) error {
	newSink, ok := sinks[to]
	if !ok {
		return outbox.Errorf(CodeUsage, "outboxctl relay", "--to %q is not available; this build supports: %s", to, supportedSinks)
	}
	db, err := a.openDB(ctx)
	if err != nil {
		return err
	}
	defer db.Close()
	if listen {
		cfg.ListenURL = a.resolvedURL()
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	if cfg.Metrics, err = prommetrics.New(reg, prommetrics.Options{BatchSize: cfg.BatchSize}); err != nil {
		return err
	}
	backlog, err := status.NewCollector(db, status.CollectorOptions{})
	if err != nil {
		return err
	}
	reg.MustRegister(backlog)

	logger := watermill.NewStdLoggerWithOut(a.stderr, false, false)
	out, classifier, err := newSink(a, sf, logger)
	if err != nil {
		return err
	}
	defer out.Close()
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
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
		srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
		go func() { _ = srv.Serve(ln) }()
		defer func() {
			sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			defer cancel()
			_ = srv.Shutdown(sctx)
		}()
		a.progress("metrics on http://%s/metrics", ln.Addr())
	}
	a.progress("relay %s publishing to %s", fwd.Owner(), to)
	if err := fwd.Run(ctx); err != nil {
		return err
	}
	a.progress("relay %s stopped", fwd.Owner())
	return nil
}

// logPublisher is the `--to log` downstream: one JSON line per message on
// stdout, confirmed as soon as the line is written.
type logPublisher struct {
	mu     sync.Mutex // the forwarder publishes concurrently; lines must not interleave
	out    io.Writer
	closed bool
}

type logLine struct {
	Topic         string            `json:"topic"`
	UUID          string            `json:"uuid"`
	Metadata      map[string]string `json:"metadata"`
	PayloadBase64 string            `json:"payload_base64"`
	PayloadText   *string           `json:"payload_text,omitempty"`
}

func (p *logPublisher) Publish(topic string, msgs ...*message.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return errors.New("log publisher closed")
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

func (p *logPublisher) Close() error {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	return nil
}
