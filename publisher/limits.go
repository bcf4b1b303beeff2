package publisher

import (
	"github.com/ThreeDotsLabs/watermill/message"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/internal/pgtext"
)

// Codes of the publisher's input limits. Each refusal happens before any
// SQL: the caller's transaction is untouched and nothing of the call is
// written.
const (
	// CodeControlCharacter: the destination, the message id or a canonical
	// field (msg.* metadata: producer, correlation id, tenant, keys, trace
	// context, schema and aggregate fields) contains a control character
	// (U+0000-U+001F, U+007F-U+009F). These values are printed by
	// outboxctl and written into relay logs; an ESC or a newline there
	// could rewrite an operator's terminal or forge a log line. Header
	// values are free text and may hold any character but NUL.
	CodeControlCharacter outbox.Code = "OUTBOX_CONTROL_CHARACTER"
	// CodePayloadTooLarge: a payload is longer than Config.MaxPayloadBytes.
	CodePayloadTooLarge outbox.Code = "OUTBOX_PAYLOAD_TOO_LARGE"
	// CodeHeadersTooLarge: a message's metadata (every key and value,
	// canonical ones included) is longer than Config.MaxHeaderBytes.
	CodeHeadersTooLarge outbox.Code = "OUTBOX_HEADERS_TOO_LARGE"
	// CodeDestinationTooLong: the topic is longer than
	// Config.MaxDestinationLength.
	CodeDestinationTooLong outbox.Code = "OUTBOX_DESTINATION_TOO_LONG"
)

// Sentinels for errors.Is.
var (
	ErrControlCharacter   = &outbox.Error{Code: CodeControlCharacter}
	ErrPayloadTooLarge    = &outbox.Error{Code: CodePayloadTooLarge}
	ErrHeadersTooLarge    = &outbox.Error{Code: CodeHeadersTooLarge}
	ErrDestinationTooLong = &outbox.Error{Code: CodeDestinationTooLong}
)

// Defaults of the input limits (Config fields left zero).
const (
	// DefaultMaxPayloadBytes is 10 MiB: above Pub/Sub's 10 MB request
	// limit, the largest a default-configured broker of the four transports
	// takes except RabbitMQ (Kafka and NATS default to 1 MB, and refuse
	// larger rows at the relay, which parks them FAILED). A larger payload
	// belongs in object storage, with its address in the message.
	DefaultMaxPayloadBytes = 10 << 20
	// DefaultMaxHeaderBytes is 64 KiB of metadata keys and values per
	// message: Pub/Sub allows 100 attributes of 256-byte keys and 1024-byte
	// values (about 128 KiB), HTTP servers commonly accept 8-64 KiB of
	// headers.
	DefaultMaxHeaderBytes = 64 << 10
	// DefaultMaxDestinationLength is 249 bytes: Kafka's topic limit, the
	// shortest of Pub/Sub (255), AMQP exchange names (255) and Kafka.
	DefaultMaxDestinationLength = 249
)

// limits are the resolved limits: a negative Config value means none.
type limits struct{ payload, headers, destination int }

func (c Config) limits() limits {
	pick := func(v, def int) int {
		switch {
		case v == 0:
			return def
		case v < 0:
			return -1
		}
		return v
	}
	return limits{
		payload:     pick(c.MaxPayloadBytes, DefaultMaxPayloadBytes),
		headers:     pick(c.MaxHeaderBytes, DefaultMaxHeaderBytes),
		destination: pick(c.MaxDestinationLength, DefaultMaxDestinationLength),
	}
}

// checkTopic refuses a topic that is too long or holds a control character.
func checkTopic(topic string, l limits) error {
	const op = "publisher.Publish"
	if l.destination >= 0 && len(topic) > l.destination {
		return outbox.Errorf(CodeDestinationTooLong, op, "topic is %d bytes; the limit is %d (Config.MaxDestinationLength)", len(topic), l.destination)
	}
	if why := pgtext.Unstorable(topic); why != "" {
		// As the envelope refuses it, and also when there are no messages.
		return outbox.Errorf(outbox.CodeInvalidHeader, op, "topic %s", why)
	}
	if i := pgtext.ControlAt(topic); i >= 0 {
		return outbox.Errorf(CodeControlCharacter, op, "topic has a control character at byte %d; destinations are printed and logged, use printable text", i)
	}
	return nil
}

// checkMessage refuses a message over the size limits; it runs before the
// envelope reads the message.
func checkMessage(msg *message.Message, i int, l limits) error {
	const op = "publisher.Publish"
	if msg == nil {
		return nil // the envelope refuses it
	}
	if l.payload >= 0 && len(msg.Payload) > l.payload {
		return outbox.Errorf(CodePayloadTooLarge, op, "message %d (%.64q): payload is %d bytes; the limit is %d (Config.MaxPayloadBytes)", i, msg.UUID, len(msg.Payload), l.payload)
	}
	if l.headers >= 0 {
		n := 0
		for k, v := range msg.Metadata {
			n += len(k) + len(v)
		}
		if n > l.headers {
			return outbox.Errorf(CodeHeadersTooLarge, op, "message %d (%.64q): metadata (headers) is %d bytes; the limit is %d (Config.MaxHeaderBytes)", i, msg.UUID, n, l.headers)
		}
	}
	return nil
}

// checkRow refuses control characters in the message id and the canonical
// fields of a row the envelope built.
func checkRow(r envelope.Row, i int) error {
	fields := [...]struct{ name, v string }{
		{"message id", r.MessageID}, {envelope.KeyProducer, r.Producer},
		{envelope.KeyCorrelationID, r.CorrelationID}, {envelope.KeyCausationID, r.CausationID},
		{envelope.KeyTenant, r.Tenant}, {envelope.KeyPartitionKey, r.PartitionKey},
		{envelope.KeyOrderingKey, r.OrderingKey}, {envelope.KeyTraceparent, r.Traceparent},
		{envelope.KeyTracestate, r.Tracestate}, {envelope.KeyBaggage, r.Baggage},
		{envelope.KeySchemaSubject, r.SchemaSubject}, {envelope.KeySchemaVersion, r.SchemaVersion},
		{envelope.KeyContentType, r.ContentType}, {envelope.KeyMessageType, r.MessageType},
		{envelope.KeyAggregateType, r.AggregateType}, {envelope.KeyAggregateID, r.AggregateID},
	}
	for _, f := range fields {
		if j := pgtext.ControlAt(f.v); j >= 0 {
			return outbox.Errorf(CodeControlCharacter, "publisher.Publish",
				"message %d: %s has a control character at byte %d; it is printed and logged, use printable text", i, f.name, j)
		}
	}
	return nil
}
