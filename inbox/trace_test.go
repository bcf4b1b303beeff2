package inbox_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/baggage"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/inbox"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/spanrec"
)

const (
	traceID    = "4bf92f3577b34da6a3ce929d0e0e4736"
	producerID = "00f067aa0ba902b7"
)

func tracedMessage() *message.Message {
	m := message.NewMessage("traced-1", []byte("hello"))
	m.Metadata.Set(envelope.KeyTraceparent, "00-"+traceID+"-"+producerID+"-01")
	m.Metadata.Set(envelope.KeyTracestate, "vendor=x")
	m.Metadata.Set(envelope.KeyBaggage, "tenant=acme")
	envelope.SetCorrelationID(m, "corr-9")
	return m
}

func TestTraceMiddlewareContinuesTheMessagesTrace(t *testing.T) {
	rec := spanrec.New()
	var inHandler trace.SpanContext
	var tenant string
	h := inbox.TraceMiddleware(inbox.TraceConfig{TracerProvider: rec, System: "nats", ConsumerGroup: "billing"})(
		func(msg *message.Message) ([]*message.Message, error) {
			inHandler = trace.SpanContextFromContext(msg.Context())
			tenant = baggage.FromContext(msg.Context()).Member("tenant").Value()
			return nil, nil
		})
	m := tracedMessage()
	throughRouter(t, "orders.paid", func(msg *message.Message) error { _, err := h(msg); return err }, m)

	spans := rec.Ended()
	require.Len(t, spans, 1)
	sp := spans[0]
	require.Equal(t, "process orders.paid", sp.Name())
	require.Equal(t, trace.SpanKindConsumer, sp.SpanKind())
	require.Equal(t, traceID, sp.SpanContext().TraceID().String(), "the producer's trace continues")
	require.Equal(t, producerID, sp.Parent().SpanID().String(), "a child of the context stored with the row")
	require.True(t, sp.Parent().IsRemote())
	require.Equal(t, "vendor=x", sp.Parent().TraceState().String())
	require.Equal(t, sp.SpanContext(), inHandler, "the handler runs under the consumer span")
	require.Equal(t, "acme", tenant, "baggage reaches the handler")
	for key, want := range map[string]any{
		"messaging.operation.type":          "process",
		"messaging.operation.name":          "process",
		"messaging.destination.name":        "orders.paid",
		"messaging.message.id":              "traced-1",
		"messaging.message.conversation_id": "corr-9",
		"messaging.message.body.size":       int64(5),
		"messaging.system":                  "nats",
		"messaging.consumer.group.name":     "billing",
	} {
		v, ok := sp.Attr(attributeKey(key))
		require.True(t, ok, key)
		require.Equal(t, want, v.AsInterface(), key)
	}
}

// throughRouter delivers m to h by a real watermill router subscribed to
// topic on a GoChannel, and returns once h has handled it.
func throughRouter(t *testing.T, topic string, h message.NoPublishHandlerFunc, m *message.Message) {
	t.Helper()
	pubsub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	defer pubsub.Close()
	r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	require.NoError(t, err)
	handled := make(chan struct{})
	r.AddConsumerHandler("traced", topic, pubsub, func(msg *message.Message) error {
		defer close(handled)
		return h(msg)
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	<-r.Running()
	require.NoError(t, pubsub.Publish(topic, m))
	<-handled
	cancel()
	require.NoError(t, <-done)
}

func TestTraceMiddlewareRecordsAHandlerError(t *testing.T) {
	rec := spanrec.New()
	boom := errors.New("boom")
	h := inbox.TraceMiddleware(inbox.TraceConfig{TracerProvider: rec})(func(*message.Message) ([]*message.Message, error) {
		return nil, boom
	})
	_, err := h(tracedMessage())
	require.Same(t, boom, err, "the handler's error is returned as it is")
	sp := rec.Ended()[0]
	c, desc := sp.Status()
	require.Equal(t, codes.Error, c)
	require.Equal(t, "boom", desc)
	require.Equal(t, []error{boom}, sp.Errors())
	_, ok := sp.Attr("messaging.system")
	require.False(t, ok, "no system configured, none claimed")
}

func TestTraceMiddlewareStartsATraceForAnUntracedMessage(t *testing.T) {
	rec := spanrec.New()
	h := inbox.TraceMiddleware(inbox.TraceConfig{TracerProvider: rec})(func(*message.Message) ([]*message.Message, error) {
		return nil, nil
	})
	_, err := h(message.NewMessage("plain", nil))
	require.NoError(t, err)
	sp := rec.Ended()[0]
	require.False(t, sp.Parent().IsValid())
	require.True(t, sp.SpanContext().IsValid())
	require.Equal(t, "process message", sp.Name(), "no router topic in the context")

	// A malformed traceparent is ignored, not trusted.
	m := message.NewMessage("bad", nil)
	m.Metadata.Set(envelope.KeyTraceparent, "00-zz-yy-01")
	_, err = h(m)
	require.NoError(t, err)
	require.False(t, rec.Ended()[1].Parent().IsValid())
}

func attributeKey(k string) attribute.Key { return attribute.Key(k) }

// What the handler publishes through inbox.Publisher continues the
// consumer's trace (TraceMiddleware outside the inbox middleware), unless
// the follow-up carries a trace of its own.
func TestAFollowUpContinuesTheConsumersTrace(t *testing.T) {
	e := newEnv(t)
	rec := spanrec.New()
	own := "00-" + strings.Repeat("1", 32) + "-" + strings.Repeat("2", 16) + "-01"
	h := inbox.TraceMiddleware(inbox.TraceConfig{TracerProvider: rec})(
		inbox.Middleware(e.db, "billing", inbox.Config{})(func(msg *message.Message) ([]*message.Message, error) {
			plain := message.NewMessage("follow-plain", []byte("f"))
			traced := message.NewMessage("follow-own", []byte("f"))
			traced.Metadata.Set(envelope.KeyTraceparent, own)
			return nil, inbox.Publisher(msg.Context()).Publish("invoices", plain, traced)
		}))
	_, err := h(tracedMessage())
	require.NoError(t, err)
	ended := rec.Ended()
	require.Len(t, ended, 1)
	consumer := ended[0].SpanContext()
	tp := func(id string) string {
		var v string
		require.NoError(t, e.db.QueryRow(`SELECT coalesce(traceparent, '') FROM messaging_outbox WHERE message_id = $1`, id).Scan(&v))
		return v
	}
	require.Equal(t, "00-"+consumer.TraceID().String()+"-"+consumer.SpanID().String()+"-01", tp("follow-plain"))
	require.Equal(t, own, tp("follow-own"), "a follow-up's own trace is kept")
}
