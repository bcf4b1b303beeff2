package debezium_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/debezium"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
	"github.com/fencedoutbox/watermill-outbox/publisher"
)

func fullRow() envelope.Row {
	v := int64(7)
	return envelope.Row{
		MessageID:        "01HZX-msg-1",
		Destination:      "orders",
		Payload:          []byte(`{"id":1}`),
		Headers:          map[string]string{"x-b": "2", "x-a": `ends\`},
		Status:           envelope.StatusPending,
		CreatedAt:        time.Date(2024, 3, 1, 10, 15, 30, 123456789, time.UTC),
		OccurredAt:       time.Date(2024, 3, 1, 9, 0, 0, 500000000, time.FixedZone("KST", 9*3600)),
		Producer:         "billing",
		CorrelationID:    "corr-1",
		CausationID:      "cause-1",
		Tenant:           "acme",
		PartitionKey:     "order-42",
		OrderingKey:      "order-42",
		Traceparent:      "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
		Tracestate:       "vendor=x",
		Baggage:          "k=v",
		SchemaSubject:    "orders-value",
		SchemaVersion:    "3",
		ContentType:      "application/json",
		MessageType:      "OrderPaid",
		AggregateType:    "Order",
		AggregateID:      "42",
		AggregateVersion: &v,
		RoutingKey:       "order-42",
	}
}

func TestRecordOfAFullRow(t *testing.T) {
	t.Parallel()
	rec := debezium.Record(fullRow(), debezium.Options{TopicPrefix: "prod."})
	require.Equal(t, "prod.orders", rec.Topic)
	require.Equal(t, "order-42", rec.Key, "the partition key when set")
	require.Equal(t, []byte(`{"id":1}`), rec.Payload)
	require.Equal(t, time.Date(2024, 3, 1, 10, 15, 30, 123000000, time.UTC), rec.Timestamp, "created_at to the millisecond")
	require.Empty(t, rec.NullHeaders)
	require.Equal(t, map[string]string{
		"id":                      "01HZX-msg-1",
		"_watermill_message_uuid": "01HZX-msg-1",
		"msg.producer":            "billing",
		"msg.occurred_at":         "2024-03-01T00:00:00.5Z",
		"msg.correlation_id":      "corr-1",
		"correlation_id":          "corr-1",
		"msg.causation_id":        "cause-1",
		"msg.tenant":              "acme",
		"msg.partition_key":       "order-42",
		"msg.ordering_key":        "order-42",
		"msg.traceparent":         "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
		"msg.tracestate":          "vendor=x",
		"msg.baggage":             "k=v",
		"msg.schema_subject":      "orders-value",
		"msg.schema_version":      "3",
		"msg.content_type":        "application/json",
		"msg.message_type":        "OrderPaid",
		"msg.aggregate_type":      "Order",
		"msg.aggregate_id":        "42",
		"msg.aggregate_version":   "7",
		"msg.headers":             `{"x-a": "ends\\", "x-b": "2"}`,
	}, rec.Headers)
}

func TestRecordOfAMinimalRowKeysByMessageIDAndNullsAreNullHeaders(t *testing.T) {
	t.Parallel()
	rec := debezium.Record(envelope.Row{
		MessageID:   "m-2",
		Destination: "audit",
		Headers:     map[string]string{},
		CreatedAt:   time.Date(2024, 1, 2, 3, 4, 5, 0, time.UTC),
	}, debezium.Options{})
	require.Equal(t, "audit", rec.Topic, "no prefix: the topic is the destination")
	require.Equal(t, "m-2", rec.Key, "the message id when no partition key is set")
	require.Equal(t, []byte{}, rec.Payload)
	require.Equal(t, map[string]string{
		"id":                      "m-2",
		"_watermill_message_uuid": "m-2",
		"msg.headers":             "{}",
	}, rec.Headers, "absent values never become empty strings")
	require.Equal(t, []string{
		"correlation_id",
		"msg.aggregate_id", "msg.aggregate_type", "msg.aggregate_version",
		"msg.baggage", "msg.causation_id", "msg.content_type", "msg.correlation_id",
		"msg.message_type", "msg.occurred_at", "msg.ordering_key", "msg.partition_key",
		"msg.producer", "msg.schema_subject", "msg.schema_version", "msg.tenant",
		"msg.traceparent", "msg.tracestate",
	}, rec.NullHeaders, "the router adds a null-valued header per NULL column")
}

func TestZonedTimestampMatchesISOOffsetDateTime(t *testing.T) {
	t.Parallel()
	require.Equal(t, "2024-03-01T10:15:30Z", debezium.ZonedTimestamp(time.Date(2024, 3, 1, 10, 15, 30, 0, time.UTC)))
	require.Equal(t, "2024-03-01T10:15:30.12Z", debezium.ZonedTimestamp(time.Date(2024, 3, 1, 10, 15, 30, 120000000, time.UTC)))
	require.Equal(t, "2024-03-01T01:15:30.000001Z", debezium.ZonedTimestamp(time.Date(2024, 3, 1, 10, 15, 30, 1999, time.FixedZone("KST", 9*3600))), "UTC, microseconds like PostgreSQL")
}

// The model's jsonb text is what PostgreSQL itself prints, which is what
// pgoutput sends and the connector forwards as the msg.headers header.
func TestJSONBTextMatchesPostgreSQL(t *testing.T) {
	t.Parallel()
	s := testdb.New(t)
	s.DB.SetMaxOpenConns(2)
	cases := []map[string]string{
		{},
		{"a": "1"},
		{"bb": "2", "a": "1", "ccc": "3", "ab": "x", "B": "upper"},
		{"trailing": `value\`, "quote": `say "hi"`, "ctl": "a\x01b\x1fc", "ws": "t\tn\nr\rb\bf\f"},
		{"unicode": "日本語 ünï 🎉", "html": "</script>&<>", "slash": "a/b", "del": "\x7f"},
		{"ключ": "значение", "é": "e"},
	}
	for _, h := range cases {
		raw, err := envelope.EncodeHeaders(h)
		require.NoError(t, err)
		var pg string
		require.NoError(t, s.DB.QueryRow(`SELECT $1::jsonb::text`, string(raw)).Scan(&pg))
		require.Equal(t, pg, debezium.JSONBText(h))
	}
}

// A row written through the real write path and read back: the model's
// headers agree with what PostgreSQL holds in each placed column.
func TestRecordAgreesWithTheStoredRow(t *testing.T) {
	t.Parallel()
	s := testdb.New(t)
	s.DB.SetMaxOpenConns(2)
	ctx := context.Background()
	msg := message.NewMessage("db-msg-1", []byte("\x00\xffbinary"))
	msg.Metadata.Set("x-app", `tail\`)
	envelope.SetOccurredAt(msg, time.Date(2024, 5, 6, 7, 8, 9, 987654321, time.UTC))
	envelope.SetAggregate(msg, "Order", "9", 12)
	envelope.SetCorrelationID(msg, "c-9")
	keyless := message.NewMessage("db-msg-2", []byte("p"))
	envelope.SetPartitionKey(msg, "pk-9")
	require.NoError(t, publisher.InTx(ctx, s.DB, publisher.Config{}, func(ctx context.Context, tx *sql.Tx, pub *publisher.Publisher) error {
		// A session time zone far from UTC: created_at_utc must still be UTC.
		if _, err := tx.ExecContext(ctx, `SET LOCAL TIME ZONE 'Asia/Seoul'`); err != nil {
			return err
		}
		return pub.Publish("orders", msg, keyless)
	}))

	for _, id := range []string{"db-msg-1", "db-msg-2"} {
		row, err := envelope.ScanRow(s.DB.QueryRow(`SELECT `+envelope.SelectColumns+` FROM messaging_outbox WHERE message_id = $1`, id))
		require.NoError(t, err)
		rec := debezium.Record(row, debezium.Options{TopicPrefix: "t."})

		var headersText, occurred sql.NullString
		var aggVersion sql.NullString
		var routingKey string
		var createdMicros, createdUTCMicros int64
		require.NoError(t, s.DB.QueryRow(`
SELECT headers::text, routing_key, aggregate_version::text,
       to_char(occurred_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US'),
       (extract(epoch FROM created_at) * 1000000)::bigint,
       (extract(epoch FROM created_at_utc) * 1000000)::bigint
FROM messaging_outbox WHERE message_id = $1`, id).Scan(&headersText, &routingKey, &aggVersion, &occurred, &createdMicros, &createdUTCMicros))
		require.Equal(t, createdMicros, createdUTCMicros, "created_at_utc is the same instant as created_at")
		require.Equal(t, routingKey, rec.Key)
		require.Equal(t, headersText.String, rec.Headers["msg.headers"])
		require.Equal(t, "t.orders", rec.Topic)
		require.Equal(t, createdMicros/1000, rec.Timestamp.UnixMilli(), "record timestamp = created_at_utc micros / 1000")
		if aggVersion.Valid {
			require.Equal(t, aggVersion.String, rec.Headers["msg.aggregate_version"])
		} else {
			require.Contains(t, rec.NullHeaders, "msg.aggregate_version")
		}
		if occurred.Valid {
			parsed, err := time.Parse(time.RFC3339Nano, rec.Headers["msg.occurred_at"])
			require.NoError(t, err)
			require.Equal(t, occurred.String, parsed.UTC().Format("2006-01-02T15:04:05.000000"))
		} else {
			require.Contains(t, rec.NullHeaders, "msg.occurred_at")
		}
	}
	rec1 := recordOf(t, s.DB, "db-msg-1")
	require.Equal(t, "pk-9", rec1.Key)
	require.Equal(t, "2024-05-06T07:08:09.987654Z", rec1.Headers["msg.occurred_at"], "PostgreSQL keeps microseconds")
	require.Equal(t, `{"x-app": "tail\\"}`, rec1.Headers["msg.headers"])
	require.Equal(t, []byte("\x00\xffbinary"), rec1.Payload)
	rec2 := recordOf(t, s.DB, "db-msg-2")
	require.Equal(t, "db-msg-2", rec2.Key)
}

func recordOf(t *testing.T, db *sql.DB, id string) debezium.EmittedRecord {
	t.Helper()
	row, err := envelope.ScanRow(db.QueryRow(`SELECT `+envelope.SelectColumns+` FROM messaging_outbox WHERE message_id = $1`, id))
	require.NoError(t, err)
	return debezium.Record(row, debezium.Options{})
}

// What a watermill-kafka subscriber sees from the CDC relay (null headers as
// empty strings) comes back as the polling relay's metadata.
func TestExpandMetadata(t *testing.T) {
	t.Parallel()
	md := message.Metadata{
		"id":                 "m-1",
		"msg.headers":        `{"x-a": "1", "x-b": "two"}`,
		"msg.tenant":         "acme",
		"msg.producer":       "",
		"msg.occurred_at":    "",
		"correlation_id":     "",
		"msg.correlation_id": "",
		"custom-consumer":    "",
	}
	require.NoError(t, debezium.ExpandMetadata(md))
	require.Equal(t, message.Metadata{
		"msg.tenant":      "acme",
		"x-a":             "1",
		"x-b":             "two",
		"custom-consumer": "",
	}, md)
}

func TestExpandMetadataRefusals(t *testing.T) {
	t.Parallel()
	cases := map[string]struct {
		md   message.Metadata
		code outbox.Code
	}{
		"not JSON":           {message.Metadata{"msg.headers": "{"}, "OUTBOX_CORRUPT_ROW"},
		"not an object":      {message.Metadata{"msg.headers": "[]"}, "OUTBOX_CORRUPT_ROW"},
		"non-string value":   {message.Metadata{"msg.headers": `{"a": 1}`}, "OUTBOX_CORRUPT_ROW"},
		"reserved name":      {message.Metadata{"msg.headers": `{"msg.tenant": "evil"}`}, "OUTBOX_RESERVED_HEADER"},
		"clashes with a key": {message.Metadata{"msg.headers": `{"x": "1"}`, "x": "2"}, "OUTBOX_RESERVED_HEADER"},
		"whitespace only":    {message.Metadata{"msg.headers": "  ", "x": "2"}, "OUTBOX_CORRUPT_ROW"},
		"line breaks only":   {message.Metadata{"msg.headers": "\n\t"}, "OUTBOX_CORRUPT_ROW"},
		// watermill-kafka's unmarshaler moves this header into msg.UUID, so
		// it is not in md to clash with; spread back it would stand in for
		// the message id (watermill-kafka's marshaler refuses it too).
		"watermill uuid":           {message.Metadata{"msg.headers": `{"_watermill_message_uuid": "forged"}`}, "OUTBOX_RESERVED_HEADER"},
		"watermill uuid, from md":  {message.Metadata{"msg.headers": `{"_watermill_message_uuid": "forged"}`, "_watermill_message_uuid": "m-1"}, "OUTBOX_RESERVED_HEADER"},
		"watermill correlation id": {message.Metadata{"msg.headers": `{"correlation_id": "c"}`}, "OUTBOX_RESERVED_HEADER"},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			before := message.Metadata{}
			for k, v := range c.md {
				before[k] = v
			}
			err := debezium.ExpandMetadata(c.md)
			require.Equal(t, c.code, outbox.CodeOf(err))
			require.Equal(t, before, c.md, "metadata is left unchanged on refusal")
		})
	}
}

// Nil metadata has nothing to expand, and an empty msg.headers (a null
// header, as watermill-kafka delivers one) means no application headers.
func TestExpandMetadataOfNilAndEmptyHeaders(t *testing.T) {
	t.Parallel()
	var md message.Metadata
	require.NoError(t, debezium.ExpandMetadata(md))
	require.Nil(t, md)

	md = message.Metadata{"msg.headers": "", "id": "m-1", "x": "1"}
	require.NoError(t, debezium.ExpandMetadata(md))
	require.Equal(t, message.Metadata{"x": "1"}, md)

	md = message.Metadata{}
	require.NoError(t, debezium.ExpandMetadata(md))
	require.Empty(t, md)
}
