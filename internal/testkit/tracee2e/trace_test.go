package tracee2e_test

import (
	"context"
	"database/sql"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wn "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	natsgo "github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/fencedoutbox/watermill-outbox/forwarder"
	"github.com/fencedoutbox/watermill-outbox/inbox"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/brokertest"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/brokertest/natstest"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/publisher"
	"github.com/fencedoutbox/watermill-outbox/transport/nats"
)

func TestOneTraceFromTheHTTPHandlerToTheConsumer(t *testing.T) {
	u := brokertest.NATSURL(t)
	subject := brokertest.Unique("orders")
	natstest.JetStream(t, u, subject, 0)
	s := testdb.New(t)

	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	tracer := tp.Tracer("shop")

	// 1. An HTTP handler writes the order's event in its transaction,
	//    under the request's server span.
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx, span := tracer.Start(r.Context(), "POST /orders", trace.WithSpanKind(trace.SpanKindServer))
		defer span.End()
		err := publisher.InTx(ctx, s.DB, publisher.Config{}, func(ctx context.Context, _ *sql.Tx, pub *publisher.Publisher) error {
			m := message.NewMessage("order-1", []byte(`{"order":1}`))
			m.SetContext(ctx)
			return pub.Publish(subject, m)
		})
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusAccepted)
	}))
	defer srv.Close()
	resp, err := http.Post(srv.URL+"/orders", "application/json", nil)
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())
	require.Equal(t, http.StatusAccepted, resp.StatusCode)

	// 2. A consumer on the real NATS server, its handler under
	//    inbox.TraceMiddleware, doing traced work of its own.
	sub, err := wn.NewSubscriber(wn.SubscriberConfig{
		URL: u, SubscribersCount: 1, AckWaitTimeout: 30 * time.Second, CloseTimeout: 10 * time.Second,
		Unmarshaler: &wn.NATSMarshaler{},
		JetStream: wn.JetStreamConfig{
			SubscribeOptions: []natsgo.SubOpt{natsgo.DeliverAll(), natsgo.AckExplicit()},
		},
	}, watermill.NopLogger{})
	require.NoError(t, err)
	defer sub.Close()
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	handled := make(chan struct{})
	r.AddConsumerHandler("billing", subject, sub, func(msg *message.Message) error {
		_, span := tracer.Start(msg.Context(), "charge card")
		span.End()
		close(handled)
		return nil
	}).AddMiddleware(inbox.TraceMiddleware(inbox.TraceConfig{TracerProvider: tp, System: "nats", ConsumerGroup: "billing"}))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	routerDone := make(chan error, 1)
	go func() { routerDone <- r.Run(ctx) }()
	<-r.Running()

	// 3. The relay publishes the row to NATS under its publish span.
	out, err := nats.NewPublisher(nats.Config{URL: u}, nil)
	require.NoError(t, err)
	defer out.Close()
	f, err := forwarder.New(s.DB, out, nil, forwarder.Config{TracerProvider: tp, Classifier: nats.Classify})
	require.NoError(t, err)
	rep, err := f.RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, 1, rep.Published)

	select {
	case <-handled:
	case <-time.After(30 * time.Second):
		t.Fatal("the consumer did not receive the message within 30 s")
	}
	cancel()
	require.NoError(t, <-routerDone)

	spans := map[string]tracetest.SpanStub{}
	for _, sp := range exp.GetSpans() {
		spans[sp.Name] = sp
	}
	httpSpan, ok := spans["POST /orders"]
	require.True(t, ok, "spans: %v", names(exp))
	relay, ok := spans["outbox.publish "+subject]
	require.True(t, ok, "spans: %v", names(exp))
	consumer, ok := spans["process "+subject]
	require.True(t, ok, "spans: %v", names(exp))
	work, ok := spans["charge card"]
	require.True(t, ok, "spans: %v", names(exp))

	traceID := httpSpan.SpanContext.TraceID()
	for _, sp := range exp.GetSpans() {
		require.Equal(t, traceID, sp.SpanContext.TraceID(), "span %q is in another trace", sp.Name)
	}
	require.Equal(t, trace.SpanKindServer, httpSpan.SpanKind)
	require.Equal(t, trace.SpanKindProducer, relay.SpanKind)
	require.Equal(t, httpSpan.SpanContext.SpanID(), relay.Parent.SpanID(), "the relay continues the context stored with the row")
	require.Equal(t, trace.SpanKindConsumer, consumer.SpanKind)
	require.Equal(t, httpSpan.SpanContext.SpanID(), consumer.Parent.SpanID(), "the consumer continues the context the message carries")
	require.True(t, consumer.Parent.IsRemote(), "it came over the broker")
	require.Equal(t, consumer.SpanContext.SpanID(), work.Parent.SpanID(), "the handler's work is under the consumer span")
	attrs := map[string]string{}
	for _, kv := range consumer.Attributes {
		attrs[string(kv.Key)] = kv.Value.Emit()
	}
	require.Equal(t, "nats", attrs["messaging.system"])
	require.Equal(t, subject, attrs["messaging.destination.name"])
	require.Equal(t, "order-1", attrs["messaging.message.id"])
	require.Equal(t, "process", attrs["messaging.operation.type"])
}

func names(exp *tracetest.InMemoryExporter) []string {
	var n []string
	for _, sp := range exp.GetSpans() {
		n = append(n, sp.Name)
	}
	return n
}
