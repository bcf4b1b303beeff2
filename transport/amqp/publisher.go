package amqp

import (
	"github.com/ThreeDotsLabs/watermill"
	wa "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	amqp091 "github.com/rabbitmq/amqp091-go"

	outbox "github.com/fencedoutbox/watermill-outbox"
)

// Config selects the broker. Only URI is required.
type Config struct {
	// URI is the AMQP URI, e.g. amqp://guest:guest@127.0.0.1:5672/.
	URI string
	// CreateMissingExchanges declares the topic's exchange when missing.
	// Off by default: a missing exchange is a rejection.
	CreateMissingExchanges bool
}

// Validate refuses a Config without a URI (OUTBOX_INVALID_CONFIG).
func (c Config) Validate() error {
	if c.URI == "" {
		return outbox.Errorf(outbox.CodeInvalidConfig, "amqp.Config", "URI is required, e.g. amqp://guest:guest@127.0.0.1:5672/")
	}
	return nil
}

// WatermillConfig is the watermill-amqp configuration NewPublisher uses:
// durable pub/sub with publisher confirms and, unless CreateMissingExchanges,
// passive exchange declaration.
func (c Config) WatermillConfig() wa.Config {
	wc := wa.NewDurablePubSubConfig(c.URI, nil)
	wc.Publish.ConfirmDelivery = true
	if !c.CreateMissingExchanges {
		wc.TopologyBuilder = &passiveTopology{}
	}
	return wc
}

// NewPublisher connects to the broker and returns the watermill publisher to
// hand to the forwarder. A nil logger logs nothing.
func NewPublisher(cfg Config, logger watermill.LoggerAdapter) (*wa.Publisher, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	return wa.NewPublisher(cfg.WatermillConfig(), logger)
}

// passiveTopology checks that the exchange exists instead of creating it;
// the broker answers 404 NOT_FOUND (closing the channel) when it does not.
type passiveTopology struct{ wa.DefaultTopologyBuilder }

func (*passiveTopology) ExchangeDeclare(ch *amqp091.Channel, name string, c wa.Config) error {
	return ch.ExchangeDeclarePassive(name, c.Exchange.Type, c.Exchange.Durable, c.Exchange.AutoDeleted,
		c.Exchange.Internal, c.Exchange.NoWait, c.Exchange.Arguments)
}
