package kafka

import (
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	wk "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
)

// Config selects the brokers and tunes the producer. Only Brokers is required.
type Config struct {
	// Brokers are the bootstrap addresses (host:port).
	Brokers []string
	// AllowAutoTopicCreation lets the broker create a missing topic on first
	// publish (if the broker allows it). Off by default: a missing topic is a
	// rejection the operator sees.
	AllowAutoTopicCreation bool
	// Sarama replaces the producer configuration entirely (nil:
	// SaramaConfig(cfg)). It must keep Producer.Return.Successes = true.
	Sarama *sarama.Config
}

// Validate refuses a Config the publisher cannot work with
// (OUTBOX_INVALID_CONFIG, naming the field).
func (c Config) Validate() error {
	const op = "kafka.Config"
	if len(c.Brokers) == 0 {
		return outbox.Errorf(outbox.CodeInvalidConfig, op, "Brokers must list at least one bootstrap address")
	}
	for _, b := range c.Brokers {
		if b == "" {
			return outbox.Errorf(outbox.CodeInvalidConfig, op, "Brokers contains an empty address")
		}
	}
	if c.Sarama != nil && !c.Sarama.Producer.Return.Successes {
		return outbox.Errorf(outbox.CodeInvalidConfig, op, "Sarama.Producer.Return.Successes must be true: the synchronous producer waits for it")
	}
	return nil
}

// SaramaConfig is the producer configuration NewPublisher uses by default:
// watermill-kafka's synchronous defaults, acks from all in-sync replicas, a
// short retry budget (the forwarder owns the long-term retry clock, so the
// client gives up early and lets the row be rescheduled) and no topic
// auto-creation unless the Config asks for it.
func SaramaConfig(c Config) *sarama.Config {
	sc := wk.DefaultSaramaSyncPublisherConfig()
	sc.Version = sarama.V2_1_0_0
	sc.Producer.RequiredAcks = sarama.WaitForAll
	sc.Producer.Retry.Max = 3
	sc.Producer.Retry.Backoff = 100 * time.Millisecond
	sc.Metadata.Retry.Max = 2
	sc.Metadata.Retry.Backoff = 250 * time.Millisecond
	sc.Metadata.AllowAutoTopicCreation = c.AllowAutoTopicCreation
	sc.ClientID = "watermill-outbox"
	return sc
}

// NewPublisher connects to the brokers and returns the watermill publisher
// to hand to the forwarder. A nil logger logs nothing.
func NewPublisher(cfg Config, logger watermill.LoggerAdapter) (*wk.Publisher, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	sc := cfg.Sarama
	if sc == nil {
		sc = SaramaConfig(cfg)
	}
	return wk.NewPublisher(wk.PublisherConfig{
		Brokers:               cfg.Brokers,
		Marshaler:             Marshaler(),
		OverwriteSaramaConfig: sc,
	}, logger)
}

// RoutingKey is the record key of msg: msg.partition_key when set, else the
// message UUID (the routing_key column's rule, envelope.RoutingKey).
func RoutingKey(msg *message.Message) string { return envelope.RoutingKey(msg) }

// Marshaler returns watermill-kafka's partitioning marshaler keyed by
// RoutingKey. Its Unmarshal is watermill-kafka's default.
func Marshaler() wk.MarshalerUnmarshaler {
	return wk.NewWithPartitioningMarshaler(func(_ string, msg *message.Message) (string, error) {
		return RoutingKey(msg), nil
	})
}
