package nats

import (
	"github.com/ThreeDotsLabs/watermill"
	wn "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	natsgo "github.com/nats-io/nats.go"

	outbox "github.com/fencedoutbox/watermill-outbox"
)

// Config selects the server. Only URL is required.
type Config struct {
	// URL is the NATS URL, e.g. nats://127.0.0.1:4222.
	URL string
	// AutoProvision creates a stream for a topic that no stream captures.
	// Off by default: such a publish is unavailable (see [Classify]): the
	// row stays PENDING with no attempt spent and the destination's breaker
	// holds its backlog until a stream answers.
	AutoProvision bool
	// NatsOptions are passed to nats.Connect unchanged.
	NatsOptions []natsgo.Option
}

// Validate refuses a Config without a URL (OUTBOX_INVALID_CONFIG).
func (c Config) Validate() error {
	if c.URL == "" {
		return outbox.Errorf(outbox.CodeInvalidConfig, "nats.Config", "URL is required, e.g. nats://127.0.0.1:4222")
	}
	return nil
}

// WatermillConfig is the watermill-nats configuration NewPublisher uses:
// JetStream, synchronous acknowledgements, the UUID as the JetStream message
// id.
func (c Config) WatermillConfig() wn.PublisherConfig {
	return wn.PublisherConfig{
		URL:               c.URL,
		NatsOptions:       c.NatsOptions,
		Marshaler:         &wn.NATSMarshaler{},
		SubjectCalculator: wn.DefaultSubjectCalculator,
		JetStream: wn.JetStreamConfig{
			AutoProvision: c.AutoProvision,
			TrackMsgId:    true,
			AckAsync:      false,
		},
	}
}

// NewPublisher connects to the server and returns the watermill publisher to
// hand to the forwarder. A nil logger logs nothing.
func NewPublisher(cfg Config, logger watermill.LoggerAdapter) (*wn.Publisher, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return wn.NewPublisher(cfg.WatermillConfig(), logger)
}
