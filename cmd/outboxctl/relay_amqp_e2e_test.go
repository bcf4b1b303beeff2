package main

import (
	"testing"
	"time"

	wa "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/brokertest"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// TestRelayToAMQP runs the built relay against a local RabbitMQ. The test
// owns the topology: the durable fanout exchange the relay publishes to and
// a throwaway queue bound to it.
func TestRelayToAMQP(t *testing.T) {
	t.Parallel()
	uri := brokertest.AMQPURL(t)
	exchange := brokertest.Unique("outboxctl-orders")
	conn, err := amqp091.Dial(uri)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	require.NoError(t, err)
	require.NoError(t, ch.ExchangeDeclare(exchange, "fanout", true, false, false, false, nil))
	t.Cleanup(func() {
		if c, err := conn.Channel(); err == nil {
			_ = c.ExchangeDelete(exchange, false, false)
		}
	})
	q, err := ch.QueueDeclare("", false, true, true, false, nil)
	require.NoError(t, err)
	require.NoError(t, ch.QueueBind(q.Name, "", exchange, false, nil))
	deliveries, err := ch.Consume(q.Name, "", true, true, false, false, nil)
	require.NoError(t, err)

	s := newSchema(t)
	missing := brokertest.Unique("outboxctl-missing")
	testdb.InsertRows(t, s.DB,
		testdb.Row(envelope.Row{MessageID: "a-1", Destination: exchange, Payload: []byte("one"), Headers: map[string]string{"app": "shop"}}),
		testdb.Row(envelope.Row{MessageID: "a-2", Destination: exchange, Payload: []byte("two")}),
		testdb.Row(envelope.Row{MessageID: "a-missing", Destination: missing, Payload: []byte("x")}))

	cmd, stderr := startRelay(t, s, nil, "--to", "amqp", "--amqp-url", uri)
	got := map[string]amqp091.Delivery{}
	deadline := time.After(45 * time.Second)
	for len(got) < 2 {
		select {
		case d := <-deliveries:
			id, _ := d.Headers[wa.DefaultMessageUUIDHeaderKey].(string)
			got[id] = d
		case <-deadline:
			t.Fatalf("received %d of 2 messages; stderr:\n%s", len(got), stderr.String())
		}
	}
	require.Equal(t, "one", string(got["a-1"].Body))
	require.Equal(t, "shop", got["a-1"].Headers["app"])
	require.Equal(t, "two", string(got["a-2"].Body))
	waitStatus(t, s, stderr, "a-1", "PUBLISHED")
	waitStatus(t, s, stderr, "a-2", "PUBLISHED")
	// amqp.Classify is the relay's classifier: the passive declaration of a
	// missing exchange is a 404 rejection (the default would retry it).
	waitStatus(t, s, stderr, "a-missing", "FAILED")
	require.Equal(t, "AMQP_NOT_FOUND", failureCode(t, s, "a-missing"))

	stopRelay(t, cmd, stderr)
}

// Bad --amqp-url values are usage errors, refused before any dial, with the
// one code relay --help documents for sink settings.
func TestRelayToAMQPBadURL(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	r := db(t, s, "relay", "--to", "amqp", "--amqp-url", "")
	requireCode(t, r, 2)
	require.Contains(t, r.stderr, "code: OUTBOX_INVALID_CONFIG")
	require.Contains(t, r.stderr, "URI is required")

	r = db(t, s, "relay", "--to", "amqp", "--amqp-url", "http://127.0.0.1:5672/")
	requireCode(t, r, 2)
	require.Contains(t, r.stderr, "code: OUTBOX_INVALID_CONFIG")
	require.Contains(t, r.stderr, "--amqp-url is not an AMQP URI")
}
