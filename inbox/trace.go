package inbox

import (
	"cmp"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/fencedoutbox/watermill-outbox/envelope"
)

// TraceConfig configures TraceMiddleware. The zero value is usable.
type TraceConfig struct {
	// TracerProvider for the consumer spans. Nil: the otel global provider.
	TracerProvider trace.TracerProvider
	// Propagator reads the trace context out of the message's metadata.
	// Nil: W3C trace context and baggage, what the outbox stores
	// (envelope.Options.Propagator's default).
	Propagator propagation.TextMapPropagator
	// System is messaging.system: the broker the message came from
	// ("nats", "rabbitmq", "kafka", "gcp_pubsub" ...). Empty: not set.
	System string
	// ConsumerGroup is messaging.consumer.group.name (for example the inbox
	// consumer name). Empty: not set.
	ConsumerGroup string
}

var defaultTracePropagator = propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})

// metadataCarrier reads the outbox's canonical trace metadata
// (msg.traceparent, msg.tracestate, msg.baggage) as the W3C header names a
// propagator asks for.
type metadataCarrier message.Metadata

var carrierKeys = map[string]string{
	"traceparent": envelope.KeyTraceparent,
	"tracestate":  envelope.KeyTracestate,
	"baggage":     envelope.KeyBaggage,
}

func (c metadataCarrier) Get(key string) string {
	if k, ok := carrierKeys[key]; ok {
		return c[k]
	}
	return ""
}

func (c metadataCarrier) Set(string, string) {} // the consumer only reads

func (c metadataCarrier) Keys() []string {
	var keys []string
	for w3c, k := range carrierKeys {
		if c[k] != "" {
			keys = append(keys, w3c)
		}
	}
	return keys
}

// TraceMiddleware continues, on the consumer side, the trace the message
// carries: the trace context the producer's transaction stored with the
// row (msg.traceparent, msg.tracestate, msg.baggage), which the forwarder
// sends on with the message. The handler runs under a consumer span that is
// a child of that context, so the producer's request, the relay's publish
// span and the consumer's work are one trace; the handler's
// msg.Context() carries the span and the baggage, so what the handler
// publishes (inbox.Publisher, or any traced client) continues it too.
//
// The span follows OpenTelemetry's messaging conventions: name
// "process <destination>", kind consumer, messaging.operation.type and
// messaging.operation.name "process", messaging.destination.name (the
// router's subscribe topic), messaging.message.id (the message UUID),
// messaging.message.conversation_id (msg.correlation_id or, when that is
// not set, watermill's correlation_id, envelope.WatermillCorrelationKey; no
// attribute when neither is set),
// messaging.message.body.size, and messaging.system and
// messaging.consumer.group.name when configured. A handler error is
// recorded on the span and sets its status to Error. A message without
// trace context starts a new trace.
//
// Put it outside inbox.Middleware (router.AddMiddleware(TraceMiddleware(...),
// inbox.Middleware(...)) or the reverse order in a handler's own list), so the
// inbox transaction runs inside the consumer span.
func TraceMiddleware(cfg TraceConfig) message.HandlerMiddleware {
	tp := cfg.TracerProvider
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	tracer := tp.Tracer("github.com/fencedoutbox/watermill-outbox/inbox")
	prop := cmp.Or[propagation.TextMapPropagator](cfg.Propagator, defaultTracePropagator)
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			orig := msg.Context()
			parent := prop.Extract(orig, metadataCarrier(msg.Metadata))
			dest := message.SubscribeTopicFromCtx(orig)
			attrs := []attribute.KeyValue{
				attribute.String("messaging.operation.type", "process"),
				attribute.String("messaging.operation.name", "process"),
				attribute.String("messaging.destination.name", dest),
				attribute.String("messaging.message.id", msg.UUID),
				attribute.Int("messaging.message.body.size", len(msg.Payload)),
			}
			if c := envelope.CorrelationID(msg); c != "" {
				attrs = append(attrs, attribute.String("messaging.message.conversation_id", c))
			}
			if cfg.System != "" {
				attrs = append(attrs, attribute.String("messaging.system", cfg.System))
			}
			if cfg.ConsumerGroup != "" {
				attrs = append(attrs, attribute.String("messaging.consumer.group.name", cfg.ConsumerGroup))
			}
			ctx, span := tracer.Start(parent, "process "+cmp.Or(dest, "message"),
				trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(attrs...))
			defer span.End()
			msg.SetContext(ctx)
			defer msg.SetContext(orig)
			produced, err := h(msg)
			if err != nil {
				span.RecordError(err)
				span.SetStatus(codes.Error, err.Error())
			}
			return produced, err
		}
	}
}
