package envelope_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
)

func spanContext(t *testing.T) trace.SpanContext {
	t.Helper()
	tid, err := trace.TraceIDFromHex("0af7651916cd43dd8448eb211c80319c")
	require.NoError(t, err)
	sid, err := trace.SpanIDFromHex("b7ad6b7169203331")
	require.NoError(t, err)
	return trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled})
}

func TestTraceContextFromMessageContextRoundTrips(t *testing.T) {
	sc := spanContext(t)
	msg := message.NewMessage("id-1", []byte("p"))
	msg.SetContext(trace.ContextWithSpanContext(context.Background(), sc))

	r, err := envelope.ToRow("t", msg, envelope.Options{})
	require.NoError(t, err)
	require.Equal(t, "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", r.Traceparent)

	back, err := envelope.ToMessage(r, envelope.Options{})
	require.NoError(t, err)
	got := trace.SpanContextFromContext(back.Context())
	require.Equal(t, sc.TraceID(), got.TraceID())
	require.Equal(t, sc.SpanID(), got.SpanID())
	require.True(t, got.IsRemote())
}

func TestExplicitTraceparentWinsOverContext(t *testing.T) {
	msg := message.NewMessage("id-1", nil)
	msg.SetContext(trace.ContextWithSpanContext(context.Background(), spanContext(t)))
	msg.Metadata.Set(envelope.KeyTraceparent, "00-11111111111111111111111111111111-2222222222222222-00")
	r, err := envelope.ToRow("t", msg, envelope.Options{})
	require.NoError(t, err)
	require.Equal(t, "00-11111111111111111111111111111111-2222222222222222-00", r.Traceparent)
}

func TestNoTraceContextStoresNothing(t *testing.T) {
	r, err := envelope.ToRow("t", message.NewMessage("id", nil), envelope.Options{})
	require.NoError(t, err)
	require.Empty(t, r.Traceparent)
	require.Empty(t, r.Tracestate)
	require.Empty(t, r.Baggage)
}

func TestCorrelationIDConventions(t *testing.T) {
	msg := message.NewMessage("id", nil)
	msg.Metadata.Set(envelope.WatermillCorrelationKey, "from-watermill")
	r, err := envelope.ToRow("t", msg, envelope.Options{})
	require.NoError(t, err)
	require.Equal(t, "from-watermill", r.CorrelationID)
	require.Empty(t, r.Headers, "correlation_id is a column, not a header")

	envelope.SetCorrelationID(msg, "canonical")
	r, err = envelope.ToRow("t", msg, envelope.Options{})
	require.NoError(t, err)
	require.Equal(t, "canonical", r.CorrelationID, "the canonical key wins")

	back, err := envelope.ToMessage(r, envelope.Options{})
	require.NoError(t, err)
	require.Equal(t, "canonical", back.Metadata.Get(envelope.WatermillCorrelationKey), "watermill's middleware keeps working downstream")
	require.Equal(t, "canonical", back.Metadata.Get(envelope.KeyCorrelationID))
}

func TestProducerAndOccurredAtFallbacks(t *testing.T) {
	created := time.Date(2026, 1, 2, 3, 4, 5, 6, time.UTC)
	r := envelope.Row{MessageID: "id", Destination: "t", Status: envelope.StatusPending, CreatedAt: created}
	back, err := envelope.ToMessage(r, envelope.Options{Producer: "relay-1"})
	require.NoError(t, err)
	require.Equal(t, "relay-1", back.Metadata.Get(envelope.KeyProducer))
	require.Equal(t, created.Format(time.RFC3339Nano), back.Metadata.Get(envelope.KeyOccurredAt))
	require.NotNil(t, back.Payload)

	r.Producer = "billing"
	back, err = envelope.ToMessage(r, envelope.Options{Producer: "relay-1"})
	require.NoError(t, err)
	require.Equal(t, "billing", back.Metadata.Get(envelope.KeyProducer), "the stored producer wins")
}

func TestToMessageRefusesReservedStoredHeaders(t *testing.T) {
	for _, k := range []string{envelope.KeyTenant, "msg.anything", envelope.WatermillCorrelationKey} {
		r := envelope.Row{MessageID: "id", Headers: map[string]string{k: "sneaky"}}
		_, err := envelope.ToMessage(r, envelope.Options{})
		require.ErrorIs(t, err, outbox.ErrReservedHeader, k)
	}
	_, err := envelope.ToMessage(envelope.Row{}, envelope.Options{})
	require.ErrorIs(t, err, outbox.ErrCorruptRow)
}

func TestDecodeHeadersRefusesWhatIsNotAFlatStringObject(t *testing.T) {
	for _, raw := range []string{`[]`, `"s"`, `{"a":1}`, `{"a":{"b":"c"}}`, `{"a":null}`, `{`, `nul`, ` `, "\t\n\r "} {
		_, err := envelope.DecodeHeaders([]byte(raw))
		require.ErrorIs(t, err, outbox.ErrCorruptRow, "%q", raw)
	}
	// Empty input (no column text) is no headers; whitespace-only is not.
	for _, raw := range [][]byte{nil, {}} {
		h, err := envelope.DecodeHeaders(raw)
		require.NoError(t, err)
		require.NotNil(t, h)
		require.Empty(t, h)
	}
}

func TestTypedSettersRemoveOnEmpty(t *testing.T) {
	msg := message.NewMessage("id", nil)
	envelope.SetTenant(msg, "acme")
	envelope.SetTenant(msg, "")
	envelope.SetOccurredAt(msg, time.Time{})
	_, ok := msg.Metadata[envelope.KeyTenant]
	require.False(t, ok)
	_, ok = msg.Metadata[envelope.KeyOccurredAt]
	require.False(t, ok)
}

func TestStatus(t *testing.T) {
	for _, s := range []envelope.Status{envelope.StatusPending, envelope.StatusInFlight, envelope.StatusPublished,
		envelope.StatusAmbiguous, envelope.StatusFailed, envelope.StatusExhausted} {
		require.True(t, s.Valid(), s)
	}
	require.False(t, envelope.Status("DONE").Valid())
	require.True(t, envelope.StatusFailed.Parked())
	require.True(t, envelope.StatusExhausted.Parked())
	require.False(t, envelope.StatusAmbiguous.Parked())
}

func TestRoutingKeyAndCorrelationIDAreToRowsRules(t *testing.T) {
	msg := message.NewMessage("id-1", nil)
	require.Equal(t, "id-1", envelope.RoutingKey(msg), "without a partition key the message id routes")
	require.Empty(t, envelope.CorrelationID(msg))

	msg.Metadata.Set(envelope.WatermillCorrelationKey, "from-watermill")
	require.Equal(t, "from-watermill", envelope.CorrelationID(msg))
	envelope.SetPartitionKey(msg, "customer-7")
	envelope.SetCorrelationID(msg, "canonical")
	require.Equal(t, "customer-7", envelope.RoutingKey(msg))
	require.Equal(t, "canonical", envelope.CorrelationID(msg), "the canonical key wins")

	r, err := envelope.ToRow("t", msg, envelope.Options{})
	require.NoError(t, err)
	require.Equal(t, envelope.RoutingKey(msg), r.RoutingKey)
	require.Equal(t, envelope.CorrelationID(msg), r.CorrelationID)
}

func TestInvalidWatermillCorrelationIsRefusedOnlyWhenUsed(t *testing.T) {
	msg := message.NewMessage("id-1", nil)
	msg.Metadata.Set(envelope.WatermillCorrelationKey, "bad\x00id")
	_, err := envelope.ToRow("t", msg, envelope.Options{})
	require.Error(t, err)
	require.NotEmpty(t, outbox.CodeOf(err))

	envelope.SetCorrelationID(msg, "canonical") // wins, so the bad fallback is ignored
	r, err := envelope.ToRow("t", msg, envelope.Options{})
	require.NoError(t, err)
	require.Equal(t, "canonical", r.CorrelationID)
}

// A tracestate set on its own (no traceparent, no span in the context) is
// kept, as every canonical field is: the same message comes back.
func TestATracestateAloneSurvives(t *testing.T) {
	m := message.NewMessage("id", nil)
	m.Metadata.Set(envelope.KeyTracestate, "vendor=x")
	r, err := envelope.ToRow("t", m, envelope.Options{})
	require.NoError(t, err)
	require.Equal(t, "vendor=x", r.Tracestate)
	back, err := envelope.ToMessage(r, envelope.Options{})
	require.NoError(t, err)
	require.Equal(t, "vendor=x", back.Metadata.Get(envelope.KeyTracestate))
}

// Values the database would refuse, or could not give back as they went in,
// are refused before any SQL with OUTBOX_INVALID_METADATA: an ordering key
// too long for its index, an occurred_at in year 0000 (RFC 3339 has it,
// PostgreSQL does not), and an occurred_at that is, to the microsecond,
// 0001-01-01T00:00:00Z: that is the zero time.Time, Row's "absent", which
// would be stored as NULL and come back as created_at. The lower bound is
// exclusive: occurred_at must lie after it.
func TestValuesTheDatabaseCannotHoldAreRefused(t *testing.T) {
	for name, md := range map[string][2]string{
		"long ordering key":        {envelope.KeyOrderingKey, strings.Repeat("k", envelope.MaxOrderingKeyLength+1)},
		"year 0000":                {envelope.KeyOccurredAt, "0000-06-01T00:00:00Z"},
		"year 0000 by zone":        {envelope.KeyOccurredAt, "0001-01-01T00:30:00+01:00"},
		"the zero instant":         {envelope.KeyOccurredAt, "0001-01-01T00:00:00Z"},
		"the zero instant by zone": {envelope.KeyOccurredAt, "0001-01-01T01:00:00+01:00"},
		"truncates to zero":        {envelope.KeyOccurredAt, "0001-01-01T00:00:00.000000999Z"},
	} {
		m := message.NewMessage("id", nil)
		m.Metadata.Set(md[0], md[1])
		_, err := envelope.ToRow("t", m, envelope.Options{})
		require.ErrorIs(t, err, outbox.ErrInvalidMetadata, name)
	}
	for _, at := range []string{"0001-01-01T00:00:00.000001Z", "9999-12-31T23:59:59.999999Z"} {
		m := message.NewMessage("id", nil)
		m.Metadata.Set(envelope.KeyOrderingKey, strings.Repeat("k", envelope.MaxOrderingKeyLength))
		m.Metadata.Set(envelope.KeyOccurredAt, at)
		r, err := envelope.ToRow("t", m, envelope.Options{})
		require.NoError(t, err, "the first and last storable microseconds are allowed: %s", at)
		back, err := envelope.ToMessage(r, envelope.Options{})
		require.NoError(t, err)
		require.Equal(t, at, back.Metadata.Get(envelope.KeyOccurredAt), "neither lost nor replaced by created_at")
	}
}

// Options.Producer stands in for msg.producer, so ToRow holds it to the same
// rule as a metadata value (OUTBOX_INVALID_HEADER) instead of leaving the
// database to fail the caller's transaction without a code. It is checked
// where it is used: a message with its own producer does not write it.
func TestToRowRefusesAnUnstorableOptionsProducer(t *testing.T) {
	for name, producer := range map[string]string{
		"NUL":               "a\x00b",
		"invalid UTF-8":     "a\xffb",
		"truncated UTF-8":   "caf\xc3",
		"lone NUL":          "\x00",
		"surrogate as UTF8": "\xed\xa0\x80",
	} {
		t.Run(name, func(t *testing.T) {
			_, err := envelope.ToRow("t", message.NewMessage("id", nil), envelope.Options{Producer: producer})
			require.ErrorIs(t, err, outbox.ErrInvalidHeader)
			require.Equal(t, outbox.CodeInvalidHeader, outbox.CodeOf(err))

			m := message.NewMessage("id", nil)
			envelope.SetProducer(m, "billing")
			r, err := envelope.ToRow("t", m, envelope.Options{Producer: producer})
			require.NoError(t, err, "the message's own producer wins; the option is not written")
			require.Equal(t, "billing", r.Producer)
		})
	}
	r, err := envelope.ToRow("t", message.NewMessage("id", nil), envelope.Options{Producer: "relay-ü"})
	require.NoError(t, err)
	require.Equal(t, "relay-ü", r.Producer)
}

// A row written by SQL with occurred_at (or created_at) outside the years
// RFC 3339 can carry is corrupt, not delivered with a msg.occurred_at no
// consumer can parse.
func TestAnOccurredAtRFC3339CannotCarryIsACorruptRow(t *testing.T) {
	for _, at := range []time.Time{
		time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC),
		time.Date(-43, 3, 15, 0, 0, 0, 0, time.UTC), // 44 BC
	} {
		_, err := envelope.ToMessage(envelope.Row{MessageID: "m", OccurredAt: at}, envelope.Options{})
		require.ErrorIs(t, err, outbox.ErrCorruptRow, "%s", at)
		_, err = envelope.ToMessage(envelope.Row{MessageID: "m", CreatedAt: at}, envelope.Options{})
		require.ErrorIs(t, err, outbox.ErrCorruptRow, "created_at %s", at)
	}
	m, err := envelope.ToMessage(envelope.Row{MessageID: "m", OccurredAt: time.Date(9999, 12, 31, 0, 0, 0, 0, time.UTC)}, envelope.Options{})
	require.NoError(t, err)
	require.Equal(t, "9999-12-31T00:00:00Z", m.Metadata.Get(envelope.KeyOccurredAt))
}

// The package doc (issue 21): producer defaults to Options.Producer, which is
// empty unless the caller sets it; it does not default to anything else.
func TestProducerDefaultsToOptionsProducerOnly(t *testing.T) {
	r := envelope.Row{MessageID: "id", Destination: "t", Status: envelope.StatusPending}
	back, err := envelope.ToMessage(r, envelope.Options{})
	require.NoError(t, err)
	require.Empty(t, back.Metadata.Get(envelope.KeyProducer))
}
