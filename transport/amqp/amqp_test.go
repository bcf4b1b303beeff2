package amqp_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wa "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/brokertest"
	"github.com/fencedoutbox/watermill-outbox/transport/amqp"
	"github.com/fencedoutbox/watermill-outbox/transport/internal/testkit/e2e"
)

func newPublisher(t *testing.T, cfg amqp.Config) *wa.Publisher {
	t.Helper()
	pub, err := amqp.NewPublisher(cfg, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	return pub
}

// rawChannel is a plain amqp091 channel for arranging broker state.
func rawChannel(t *testing.T, uri string) *amqp091.Channel {
	t.Helper()
	conn, err := amqp091.Dial(uri)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	require.NoError(t, err)
	return ch
}

func TestMissingExchangeIsRejected(t *testing.T) {
	uri := brokertest.AMQPURL(t)
	pub := newPublisher(t, amqp.Config{URI: uri})
	err := pub.Publish(brokertest.Unique("missing"), message.NewMessage("m1", []byte("x")))
	require.Error(t, err)
	require.Equal(t, forwarder.Verdict{Outcome: forwarder.Rejected, Code: "AMQP_NOT_FOUND"}, amqp.Classify(err), "error: %v", err)
}

func TestReservedExchangeNameIsAccessRefused(t *testing.T) {
	uri := brokertest.AMQPURL(t)
	pub := newPublisher(t, amqp.Config{URI: uri, CreateMissingExchanges: true})
	err := pub.Publish(brokertest.Unique("amq.outbox"), message.NewMessage("m1", []byte("x")))
	require.Error(t, err)
	require.Equal(t, forwarder.Verdict{Outcome: forwarder.Rejected, Code: "AMQP_ACCESS_REFUSED"}, amqp.Classify(err), "error: %v", err)
}

func TestIncompatibleExchangeIsPreconditionFailed(t *testing.T) {
	uri := brokertest.AMQPURL(t)
	name := brokertest.Unique("direct")
	ch := rawChannel(t, uri)
	require.NoError(t, ch.ExchangeDeclare(name, "direct", false, true, false, false, nil))
	pub := newPublisher(t, amqp.Config{URI: uri, CreateMissingExchanges: true})
	err := pub.Publish(name, message.NewMessage("m1", []byte("x"))) // declares it durable fanout
	require.Error(t, err)
	require.Equal(t, forwarder.Verdict{Outcome: forwarder.Rejected, Code: "AMQP_PRECONDITION_FAILED"}, amqp.Classify(err), "error: %v", err)
}

func TestClassifyAmbiguous(t *testing.T) {
	require.Equal(t, forwarder.Confirmed, amqp.Classify(nil).Outcome)
	require.Equal(t, forwarder.Verdict{Outcome: forwarder.Unavailable, Code: amqp.CodeClosed}, amqp.Classify(amqp091.ErrClosed),
		"a closed connection or channel sent nothing: unavailable, no attempt spent")
	for _, err := range []error{
		errors.New("delivery not confirmed for message [m1]"), errors.New("not connected to AMQP"),
		&amqp091.Error{Code: amqp091.ConnectionForced, Reason: "shutdown"}, context.DeadlineExceeded,
	} {
		require.Equal(t, forwarder.Ambiguous, amqp.Classify(err).Outcome, "%v", err)
	}
	// 311 CONTENT_TOO_LARGE: RabbitMQ's max_message_size defaults to 128 MiB
	// (its hard limit is 512 MiB), too large to provoke in a test, so this
	// rule is checked on the error value the client library would return.
	require.Equal(t, forwarder.Verdict{Outcome: forwarder.Rejected, Code: "AMQP_CONTENT_TOO_LARGE"},
		amqp.Classify(&amqp091.Error{Code: amqp091.ContentTooLarge, Reason: "message too large"}))
}

func TestConfigValidation(t *testing.T) {
	_, err := amqp.NewPublisher(amqp.Config{}, nil)
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
}

func TestEndToEnd(t *testing.T) {
	uri := brokertest.AMQPURL(t)
	topic := brokertest.Unique("orders")
	// A throwaway queue bound to the durable fanout exchange the relay
	// publishes to; the subscriber declares both.
	subCfg := wa.NewNonDurablePubSubConfig(uri, func(topic string) string { return topic + "-e2e" })
	subCfg.Exchange.Durable = true
	sub, err := wa.NewSubscriber(subCfg, watermill.NopLogger{})
	require.NoError(t, err)
	defer sub.Close()
	// Remove the durable exchange the subscriber declared.
	defer func() { _ = rawChannel(t, uri).ExchangeDelete(topic, false, false) }()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	received, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)

	pub := newPublisher(t, amqp.Config{URI: uri})
	e2e.Relay(t, topic, pub, amqp.Classify)
	e2e.Check(t, e2e.Receive(t, received, len(e2e.Messages()), 20*time.Second))
}
