package main

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/spf13/cobra"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
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
	f.Var(&fenceFlag{&cfg.Fence}, "fence", "fence scheme: rows (per-row leases, the default) or lanes (relays own lanes: one row version per message; docs/FENCE.md)")
	f.BoolVar(&printGrace, "print-grace", false, "print the seconds a stop may take with these settings (the grace period to give the relay) and exit")
	envFlags(cmd)
	return cmd
}

// fenceFlag is --fence: rows or lanes.
type fenceFlag struct{ f *forwarder.Fence }

func (v *fenceFlag) String() string {
	if v.f == nil || *v.f == forwarder.FenceRows {
		return "rows"
	}
	return "lanes"
}

func (v *fenceFlag) Set(s string) error {
	switch s {
	case "rows":
		*v.f = forwarder.FenceRows
	case "lanes":
		*v.f = forwarder.FenceLanes
	default:
		return fmt.Errorf("%q is not a fence scheme (rows or lanes)", s)
	}
	return nil
}

func (v *fenceFlag) Type() string { return "rows|lanes" }
