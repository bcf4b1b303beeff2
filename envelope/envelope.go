package envelope

import (
	"context"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/propagation"

	outbox "github.com/fencedoutbox/watermill-outbox"
)

// MaxMessageIDLength bounds message ids (bytes). Ids are text, not uuid:
// watermill users also send ULIDs and other ids.
const MaxMessageIDLength = 255

// MaxOrderingKeyLength bounds ordering keys (bytes): the key is in an index
// (ordering key, seq), whose entries PostgreSQL caps at about 2.7 KB, and a
// longer key would fail in the database, aborting the caller's transaction,
// instead of being refused here.
const MaxOrderingKeyLength = 1024

// storableYear reports whether t (in UTC) is in the years both RFC 3339
// (0000-9999) and PostgreSQL (no year 0) can carry: a msg.occurred_at
// outside them could not come back as it went in.
func storableYear(t time.Time) bool {
	y := t.UTC().Year()
	return y >= 1 && y <= 9999
}

// Options tune the conversion. The zero value is usable.
type Options struct {
	// Producer is written to the producer column when the message carries no
	// KeyProducer (write side), and restored as KeyProducer when the row has
	// none (read side: the relay's identity). ToRow refuses one it would
	// write that PostgreSQL text cannot hold (NUL, invalid UTF-8) with
	// OUTBOX_INVALID_HEADER, as it refuses such a metadata value.
	Producer string
	// Propagator moves trace context between msg.Context() and the
	// traceparent/tracestate/baggage columns. Nil means W3C trace context
	// plus W3C baggage.
	Propagator propagation.TextMapPropagator
}

var defaultPropagator = propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})

func (o Options) propagator() propagation.TextMapPropagator {
	if o.Propagator != nil {
		return o.Propagator
	}
	return defaultPropagator
}

func corrupt(format string, args ...any) error {
	return outbox.Errorf(outbox.CodeCorruptRow, "envelope.ToMessage", format, args...)
}

// ToRow turns a watermill message bound for topic into the insertable part of
// a row (identity, payload, headers and canonical columns). msg.UUID becomes
// message_id; canonical msg.* keys and watermill's correlation_id go to their
// columns; trace context comes from the metadata keys or, when absent, from
// msg.Context(); every other key goes to headers. Refusals are *outbox.Error
// with codes OUTBOX_TOPIC_REQUIRED, OUTBOX_MESSAGE_ID_REQUIRED,
// OUTBOX_MESSAGE_ID_TOO_LONG, OUTBOX_RESERVED_HEADER, OUTBOX_INVALID_HEADER,
// OUTBOX_INVALID_TENANT and OUTBOX_INVALID_METADATA.
func ToRow(topic string, msg *message.Message, opts Options) (Row, error) {
	const op = "envelope.ToRow"
	if topic == "" {
		return Row{}, outbox.Errorf(outbox.CodeTopicRequired, op, "topic must not be empty")
	}
	if err := checkText("topic", topic); err != nil {
		return Row{}, err
	}
	if msg == nil {
		return Row{}, outbox.Errorf(outbox.CodeMessageIDRequired, op, "message is nil")
	}
	if msg.UUID == "" {
		return Row{}, outbox.Errorf(outbox.CodeMessageIDRequired, op, "message id (msg.UUID) must not be empty")
	}
	if len(msg.UUID) > MaxMessageIDLength {
		return Row{}, outbox.Errorf(outbox.CodeMessageIDTooLong, op, "message id is %d bytes, at most %d allowed", len(msg.UUID), MaxMessageIDLength)
	}
	if err := checkText("message id", msg.UUID); err != nil {
		return Row{}, err
	}
	r := Row{
		MessageID:   msg.UUID,
		Destination: topic,
		Payload:     msg.Payload,
		Headers:     map[string]string{},
		Status:      StatusPending,
	}
	if r.Payload == nil {
		r.Payload = []byte{}
	}
	for k, v := range msg.Metadata {
		switch {
		case k == WatermillCorrelationKey:
			continue // a fallback for correlation_id, checked below when used
		case len(k) >= len(ReservedPrefix) && k[:len(ReservedPrefix)] == ReservedPrefix:
			if !isCanonical(k) {
				return Row{}, outbox.Errorf(outbox.CodeReservedHeader, op, "metadata key %q is in the reserved %q namespace and is not a canonical field", k, ReservedPrefix)
			}
			if err := checkText("metadata "+k, v); err != nil {
				return Row{}, err
			}
			if err := r.setCanonical(k, v); err != nil {
				return Row{}, err
			}
		default:
			r.Headers[k] = v
		}
	}
	r.CorrelationID = CorrelationID(msg)
	if r.CorrelationID != "" && msg.Metadata.Get(KeyCorrelationID) == "" {
		// The value came from watermill's key, which the loop did not check.
		if err := checkText("metadata "+WatermillCorrelationKey, r.CorrelationID); err != nil {
			return Row{}, err
		}
	}
	if r.Producer == "" && opts.Producer != "" {
		// The fallback, checked as the metadata value it stands for.
		if err := checkText("Options.Producer", opts.Producer); err != nil {
			return Row{}, err
		}
		r.Producer = opts.Producer
	}
	if r.Traceparent == "" && msg.Context() != nil {
		carrier := propagation.MapCarrier{}
		opts.propagator().Inject(msg.Context(), carrier)
		if tp := carrier["traceparent"]; tp != "" {
			// The context's span: its traceparent and tracestate go together.
			// Without one, a tracestate set on its own stays.
			r.Traceparent, r.Tracestate = tp, carrier["tracestate"]
		}
		if r.Baggage == "" {
			r.Baggage = carrier["baggage"]
		}
	}
	if err := validateHeaders(r.Headers); err != nil {
		return Row{}, err
	}
	r.RoutingKey = RoutingKey(msg)
	return r, nil
}

func (r *Row) setCanonical(k, v string) error {
	const op = "envelope.ToRow"
	if v == "" {
		return nil // absent
	}
	switch k {
	case KeyProducer:
		r.Producer = v
	case KeyOccurredAt:
		t, err := time.Parse(time.RFC3339Nano, v)
		if err != nil {
			return outbox.Wrap(outbox.CodeInvalidMetadata, op, err, KeyOccurredAt+" must be RFC 3339")
		}
		if !storableYear(t) {
			return outbox.Errorf(outbox.CodeInvalidMetadata, op, "%s %q is in year %d (UTC); use a time after 0001-01-01T00:00:00Z and in year 9999 or before", KeyOccurredAt, v, t.UTC().Year())
		}
		// The column keeps microseconds; truncated here, not rounded by
		// PostgreSQL, so what is stored is what SetOccurredAt wrote.
		t = t.Truncate(time.Microsecond)
		if t.IsZero() {
			// The zero time is Row's "absent" (stored as NULL, read back as
			// created_at): the value would be lost and another invented.
			return outbox.Errorf(outbox.CodeInvalidMetadata, op, "%s %q is (to the microsecond) 0001-01-01T00:00:00Z, which stands for no occurred_at; use a time after it", KeyOccurredAt, v)
		}
		r.OccurredAt = t
	case KeyCorrelationID:
		r.CorrelationID = v
	case KeyCausationID:
		r.CausationID = v
	case KeyTenant:
		if err := ValidateTenant(v); err != nil {
			return err
		}
		r.Tenant = v
	case KeyPartitionKey:
		r.PartitionKey = v
	case KeyOrderingKey:
		if len(v) > MaxOrderingKeyLength {
			return outbox.Errorf(outbox.CodeInvalidMetadata, op, "%s is %d bytes, at most %d allowed (it is indexed)", KeyOrderingKey, len(v), MaxOrderingKeyLength)
		}
		r.OrderingKey = v
	case KeyTraceparent:
		r.Traceparent = v
	case KeyTracestate:
		r.Tracestate = v
	case KeyBaggage:
		r.Baggage = v
	case KeySchemaSubject:
		r.SchemaSubject = v
	case KeySchemaVersion:
		r.SchemaVersion = v
	case KeyContentType:
		r.ContentType = v
	case KeyMessageType:
		r.MessageType = v
	case KeyAggregateType:
		r.AggregateType = v
	case KeyAggregateID:
		r.AggregateID = v
	case KeyAggregateVersion:
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			return outbox.Wrap(outbox.CodeInvalidMetadata, op, err, KeyAggregateVersion+" must be a base-10 int64")
		}
		r.AggregateVersion = &n
	}
	return nil
}

// ToMessage rebuilds the watermill message a row stands for: msg.UUID is the
// message id, the payload is the stored bytes, headers come back as metadata,
// every non-empty canonical column comes back under its msg.* key (and the
// correlation id also under watermill's correlation_id), occurred_at falls
// back to created_at and producer to opts.Producer. The message context
// carries the stored trace context, so a span started from it continues the
// producer's trace. A row whose headers use a reserved name is refused with
// OUTBOX_RESERVED_HEADER: the envelope never silently overwrites.
func ToMessage(r Row, opts Options) (*message.Message, error) {
	if r.MessageID == "" {
		return nil, corrupt("row has an empty message id")
	}
	md := make(message.Metadata, len(r.Headers)+8)
	for k, v := range r.Headers {
		if IsReserved(k) {
			return nil, outbox.Errorf(outbox.CodeReservedHeader, "envelope.ToMessage", "row %s: stored header %q uses a reserved name", r.MessageID, k)
		}
		md[k] = v
	}
	put := func(k, v string) {
		if v != "" {
			md[k] = v
		}
	}
	put(KeyProducer, firstNonEmpty(r.Producer, opts.Producer))
	occurred := r.OccurredAt
	if occurred.IsZero() {
		occurred = r.CreatedAt
	}
	if !occurred.IsZero() {
		u := occurred.UTC()
		if !storableYear(u) {
			return nil, corrupt("row %s: occurred_at (or created_at) %s is outside the years 0001-9999 that %s (RFC 3339) can carry", r.MessageID, u.Format(time.RFC3339Nano), KeyOccurredAt)
		}
		md[KeyOccurredAt] = u.Format(time.RFC3339Nano)
	}
	put(KeyCorrelationID, r.CorrelationID)
	put(WatermillCorrelationKey, r.CorrelationID)
	put(KeyCausationID, r.CausationID)
	put(KeyTenant, r.Tenant)
	put(KeyPartitionKey, r.PartitionKey)
	put(KeyOrderingKey, r.OrderingKey)
	put(KeyTraceparent, r.Traceparent)
	put(KeyTracestate, r.Tracestate)
	put(KeyBaggage, r.Baggage)
	put(KeySchemaSubject, r.SchemaSubject)
	put(KeySchemaVersion, r.SchemaVersion)
	put(KeyContentType, r.ContentType)
	put(KeyMessageType, r.MessageType)
	put(KeyAggregateType, r.AggregateType)
	put(KeyAggregateID, r.AggregateID)
	if r.AggregateVersion != nil {
		md[KeyAggregateVersion] = strconv.FormatInt(*r.AggregateVersion, 10)
	}
	payload := r.Payload
	if payload == nil {
		payload = []byte{}
	}
	msg := message.NewMessage(r.MessageID, payload)
	msg.Metadata = md
	msg.SetContext(TraceContext(context.Background(), r, opts))
	return msg, nil
}

// TraceContext returns ctx carrying the trace context stored in the row
// (traceparent, tracestate, baggage), extracted with opts' propagator.
func TraceContext(ctx context.Context, r Row, opts Options) context.Context {
	if r.Traceparent == "" && r.Baggage == "" {
		return ctx
	}
	carrier := propagation.MapCarrier{}
	if r.Traceparent != "" {
		carrier["traceparent"] = r.Traceparent
	}
	if r.Tracestate != "" {
		carrier["tracestate"] = r.Tracestate
	}
	if r.Baggage != "" {
		carrier["baggage"] = r.Baggage
	}
	return opts.propagator().Extract(ctx, carrier)
}

func firstNonEmpty(a, b string) string {
	if a != "" {
		return a
	}
	return b
}
