package envelope

import (
	"cmp"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// ReservedPrefix is the metadata namespace the envelope owns. A key under it
// that is not one of the canonical keys below is refused on the way in, and a
// stored header under it is refused on the way out.
const ReservedPrefix = "msg."

// Canonical metadata keys. On the way in each goes to its own column; on the
// way out each column comes back under the same key. Values are strings;
// KeyOccurredAt is RFC 3339 (a value with more than microseconds is
// truncated to microseconds on the way in, as the column keeps them) after
// 0001-01-01T00:00:00Z and in year 9999 or before,
// KeyAggregateVersion a base-10 int64.
const (
	KeyProducer         = "msg.producer"
	KeyOccurredAt       = "msg.occurred_at"
	KeyCorrelationID    = "msg.correlation_id"
	KeyCausationID      = "msg.causation_id"
	KeyTenant           = "msg.tenant"
	KeyPartitionKey     = "msg.partition_key"
	KeyOrderingKey      = "msg.ordering_key"
	KeyTraceparent      = "msg.traceparent"
	KeyTracestate       = "msg.tracestate"
	KeyBaggage          = "msg.baggage"
	KeySchemaSubject    = "msg.schema_subject"
	KeySchemaVersion    = "msg.schema_version"
	KeyContentType      = "msg.content_type"
	KeyMessageType      = "msg.message_type"
	KeyAggregateType    = "msg.aggregate_type"
	KeyAggregateID      = "msg.aggregate_id"
	KeyAggregateVersion = "msg.aggregate_version"
)

// WatermillCorrelationKey is the metadata key watermill's CorrelationID
// middleware reads and writes. On the way in it fills correlation_id (unless
// KeyCorrelationID is set too, which wins); on the way out it is set with
// KeyCorrelationID so watermill's middleware keeps working downstream.
const WatermillCorrelationKey = "correlation_id"

// CanonicalKeys lists every canonical key, in column order.
var CanonicalKeys = []string{
	KeyProducer, KeyOccurredAt, KeyCorrelationID, KeyCausationID, KeyTenant,
	KeyPartitionKey, KeyOrderingKey, KeyTraceparent, KeyTracestate, KeyBaggage,
	KeySchemaSubject, KeySchemaVersion, KeyContentType, KeyMessageType,
	KeyAggregateType, KeyAggregateID, KeyAggregateVersion,
}

// IsReserved reports whether key may not appear in the headers column.
func IsReserved(key string) bool {
	return strings.HasPrefix(key, ReservedPrefix) || key == WatermillCorrelationKey
}

func isCanonical(key string) bool {
	for _, k := range CanonicalKeys {
		if k == key {
			return true
		}
	}
	return false
}

// Typed setters. Each writes the canonical key into msg.Metadata; an empty
// value removes it (absent, never an empty column).

func set(msg *message.Message, key, value string) {
	if msg.Metadata == nil {
		msg.Metadata = message.Metadata{}
	}
	if value == "" {
		delete(msg.Metadata, key)
		return
	}
	msg.Metadata.Set(key, value)
}

// SetProducer names the service that wrote the message.
func SetProducer(msg *message.Message, producer string) { set(msg, KeyProducer, producer) }

// SetOccurredAt records when the business fact happened, truncated to
// microseconds: the column (timestamptz) keeps microseconds, so the value
// set here is exactly the one the consumer receives. (Without the
// truncation PostgreSQL would round a nanosecond value and the consumer would
// see another string.)
func SetOccurredAt(msg *message.Message, t time.Time) {
	if t.IsZero() {
		set(msg, KeyOccurredAt, "")
		return
	}
	set(msg, KeyOccurredAt, t.UTC().Truncate(time.Microsecond).Format(time.RFC3339Nano))
}

// SetCorrelationID sets the correlation id (also readable by watermill's
// CorrelationID middleware downstream).
func SetCorrelationID(msg *message.Message, id string) { set(msg, KeyCorrelationID, id) }

// SetCausationID names the message that caused this one.
func SetCausationID(msg *message.Message, id string) { set(msg, KeyCausationID, id) }

// SetTenant sets the tenant slug; it must match ^[a-z0-9][a-z0-9._-]{0,63}$
// (checked at Publish).
func SetTenant(msg *message.Message, tenant string) { set(msg, KeyTenant, tenant) }

// SetPartitionKey sets the downstream key (Kafka record key, Pub/Sub ordering
// key). Without it the routing key is the message id.
func SetPartitionKey(msg *message.Message, key string) { set(msg, KeyPartitionKey, key) }

// SetOrderingKey makes the relay publish rows sharing key in insertion order.
func SetOrderingKey(msg *message.Message, key string) { set(msg, KeyOrderingKey, key) }

// SetMessageType sets the event name, e.g. "OrderPaid".
func SetMessageType(msg *message.Message, t string) { set(msg, KeyMessageType, t) }

// SetContentType sets the payload's media type, e.g. "application/json".
func SetContentType(msg *message.Message, ct string) { set(msg, KeyContentType, ct) }

// SetSchema references the payload schema.
func SetSchema(msg *message.Message, subject, version string) {
	set(msg, KeySchemaSubject, subject)
	set(msg, KeySchemaVersion, version)
}

// SetAggregate names the aggregate the event belongs to and its version.
func SetAggregate(msg *message.Message, aggregateType, aggregateID string, version int64) {
	set(msg, KeyAggregateType, aggregateType)
	set(msg, KeyAggregateID, aggregateID)
	set(msg, KeyAggregateVersion, strconv.FormatInt(version, 10))
}

// RoutingKey is the downstream key of msg: msg.partition_key when set, else
// the message UUID. It is the rule of the generated routing_key column, and
// ToRow fills Row.RoutingKey with it.
func RoutingKey(msg *message.Message) string {
	return cmp.Or(msg.Metadata.Get(KeyPartitionKey), msg.UUID)
}

// CorrelationID is the correlation id of msg: msg.correlation_id when set,
// else watermill's correlation_id (WatermillCorrelationKey). ToRow fills
// Row.CorrelationID with it.
func CorrelationID(msg *message.Message) string {
	return cmp.Or(msg.Metadata.Get(KeyCorrelationID), msg.Metadata.Get(WatermillCorrelationKey))
}
