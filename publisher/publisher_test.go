package publisher_test

import (
	"context"
	"database/sql"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/publisher"
)

func TestCommitMakesBusinessChangeAndRowVisibleTogether(t *testing.T) {
	s := newSchema(t)
	_, err := s.DB.Exec(`CREATE TABLE orders (id int PRIMARY KEY, paid bool NOT NULL)`)
	require.NoError(t, err)
	other := s.Open(t) // a second process's view

	tx := begin(t, s.DB, nil)
	_, err = tx.Exec(`INSERT INTO orders VALUES (1, true)`)
	require.NoError(t, err)
	pub, err := publisher.New(tx, publisher.Config{Producer: "billing"}, watermill.NopLogger{})
	require.NoError(t, err)
	m := newMsg(t, `{"order":1}`)
	require.NoError(t, pub.Publish("orders.paid", m))

	var orders, rows int
	require.NoError(t, other.QueryRow(`SELECT (SELECT count(*) FROM orders), (SELECT count(*) FROM messaging_outbox)`).Scan(&orders, &rows))
	require.Equal(t, [2]int{0, 0}, [2]int{orders, rows}, "nothing is visible before commit")

	require.NoError(t, tx.Commit())
	require.NoError(t, other.QueryRow(`SELECT (SELECT count(*) FROM orders), (SELECT count(*) FROM messaging_outbox WHERE message_id = $1 AND status = 'PENDING')`, m.UUID).Scan(&orders, &rows))
	require.Equal(t, [2]int{1, 1}, [2]int{orders, rows}, "both commit together")
}

func TestRollbackDiscardsBusinessChangeAndRow(t *testing.T) {
	s := newSchema(t)
	_, err := s.DB.Exec(`CREATE TABLE orders (id int PRIMARY KEY, paid bool NOT NULL)`)
	require.NoError(t, err)
	tx := begin(t, s.DB, nil)
	_, err = tx.Exec(`INSERT INTO orders VALUES (1, true)`)
	require.NoError(t, err)
	pub, err := publisher.New(tx, publisher.Config{}, nil)
	require.NoError(t, err)
	require.NoError(t, pub.Publish("orders.paid", newMsg(t, "a"), newMsg(t, "b")))
	require.NoError(t, tx.Rollback())

	var orders, rows int
	require.NoError(t, s.Open(t).QueryRow(`SELECT (SELECT count(*) FROM orders), (SELECT count(*) FROM messaging_outbox)`).Scan(&orders, &rows))
	require.Equal(t, [2]int{0, 0}, [2]int{orders, rows})
}

func TestOneCallWritesAllMessagesInOrder(t *testing.T) {
	s := newSchema(t)
	tx := begin(t, s.DB, nil)
	pub, err := publisher.New(tx, publisher.Config{}, nil)
	require.NoError(t, err)
	var msgs []*message.Message
	var want []string
	for i := range 50 {
		m := message.NewMessage("m-"+strings.Repeat("z", 50-i), nil) // ids sort opposite to call order
		msgs = append(msgs, m)
		want = append(want, m.UUID)
	}
	require.NoError(t, pub.Publish("t", msgs...))
	require.NoError(t, pub.Publish("t")) // no messages: writes nothing
	// ... but the topic is still checked (Publish's doc says so).
	require.ErrorIs(t, pub.Publish(""), outbox.ErrTopicRequired)
	require.NoError(t, tx.Commit())

	rows, err := s.DB.Query(`SELECT message_id, payload FROM messaging_outbox ORDER BY seq`)
	require.NoError(t, err)
	defer rows.Close()
	var got []string
	for rows.Next() {
		var id string
		var payload []byte
		require.NoError(t, rows.Scan(&id, &payload))
		require.NotNil(t, payload, "a nil payload is stored as empty bytes, never NULL")
		got = append(got, id)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, want, got, "seq follows the order of the call")
}

// TestEveryColumnRoundTrips runs once with both messages in one call (the
// unnest statement) and once with one message per call (the VALUES one).
func TestEveryColumnRoundTrips(t *testing.T) {
	t.Run("batch", func(t *testing.T) { everyColumnRoundTrips(t, true) })
	t.Run("one per call", func(t *testing.T) { everyColumnRoundTrips(t, false) })
}

func everyColumnRoundTrips(t *testing.T, together bool) {
	s := newSchema(t)
	occurred := time.Date(2026, 3, 4, 5, 6, 7, 123456000, time.UTC)
	traceID := trace.TraceID{0x4b, 0xf9, 0x2f, 0x35, 0x77, 0xb3, 0x4d, 0xa6, 0xa3, 0xce, 0x92, 0x9d, 0x0e, 0x0e, 0x47, 0x36}
	spanID := trace.SpanID{0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7}
	ts, err := trace.ParseTraceState("vendor=abc")
	require.NoError(t, err)
	sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: traceID, SpanID: spanID, TraceFlags: trace.FlagsSampled, TraceState: ts, Remote: true})

	full := message.NewMessage("full-"+randomID(t), []byte{0, 1, 2, 0xff, 'x'}) // payload is bytes, NUL included
	full.SetContext(trace.ContextWithSpanContext(context.Background(), sc))
	envelope.SetProducer(full, "billing-override")
	envelope.SetOccurredAt(full, occurred)
	envelope.SetCorrelationID(full, "corr-1")
	envelope.SetCausationID(full, "cause-1")
	envelope.SetTenant(full, "acme.eu-1")
	envelope.SetPartitionKey(full, "order-42")
	envelope.SetOrderingKey(full, "order-42-seq")
	envelope.SetMessageType(full, "OrderPaid")
	envelope.SetContentType(full, "application/json")
	envelope.SetSchema(full, "orders.v1", "7")
	envelope.SetAggregate(full, "Order", "42", 9)
	full.Metadata.Set("x-app", "kept")
	full.Metadata.Set("x-empty", "")

	bare := message.NewMessage("bare-"+randomID(t), []byte("b"))
	bare.Metadata.Set(envelope.WatermillCorrelationKey, "wm-corr")

	tx := begin(t, s.DB, nil)
	pub, err := publisher.New(tx, publisher.Config{Producer: "billing"}, nil)
	require.NoError(t, err)
	if together {
		require.NoError(t, pub.Publish("orders.paid", full, bare))
	} else {
		require.NoError(t, pub.Publish("orders.paid", full))
		require.NoError(t, pub.Publish("orders.paid", bare))
	}
	require.NoError(t, tx.Commit())

	r := readRow(t, s.DB, full.UUID)
	require.Equal(t, full.UUID, r.MessageID)
	require.Equal(t, "orders.paid", r.Destination)
	require.Equal(t, []byte{0, 1, 2, 0xff, 'x'}, r.Payload)
	require.Equal(t, map[string]string{"x-app": "kept", "x-empty": ""}, r.Headers)
	require.Equal(t, envelope.StatusPending, r.Status)
	require.NotZero(t, r.Seq)
	require.False(t, r.CreatedAt.IsZero())
	require.True(t, occurred.Equal(r.OccurredAt), "occurred_at %v", r.OccurredAt)
	require.Zero(t, r.Attempts)
	require.Equal(t, "billing-override", r.Producer, "the message's own producer wins over the config")
	require.Equal(t, "corr-1", r.CorrelationID)
	require.Equal(t, "cause-1", r.CausationID)
	require.Equal(t, "acme.eu-1", r.Tenant)
	require.Equal(t, "order-42", r.PartitionKey)
	require.Equal(t, "order-42-seq", r.OrderingKey)
	require.Equal(t, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", r.Traceparent)
	require.Equal(t, "vendor=abc", r.Tracestate)
	require.Equal(t, "orders.v1", r.SchemaSubject)
	require.Equal(t, "7", r.SchemaVersion)
	require.Equal(t, "application/json", r.ContentType)
	require.Equal(t, "OrderPaid", r.MessageType)
	require.Equal(t, "Order", r.AggregateType)
	require.Equal(t, "42", r.AggregateID)
	require.NotNil(t, r.AggregateVersion)
	require.Equal(t, int64(9), *r.AggregateVersion)
	require.Equal(t, "order-42", r.RoutingKey, "routing_key is the partition key when set")

	back, err := envelope.ToMessage(r, envelope.Options{Producer: "relay"})
	require.NoError(t, err)
	require.Equal(t, full.UUID, back.UUID)
	require.Equal(t, []byte(full.Payload), []byte(back.Payload))
	want := message.Metadata{}
	for k, v := range full.Metadata {
		want[k] = v
	}
	want[envelope.KeyTraceparent] = r.Traceparent
	want[envelope.KeyTracestate] = r.Tracestate
	want[envelope.WatermillCorrelationKey] = "corr-1"
	require.Equal(t, want, back.Metadata)
	got := trace.SpanContextFromContext(back.Context())
	require.Equal(t, traceID, got.TraceID(), "the stored trace context is restored into msg.Context()")
	require.Equal(t, spanID, got.SpanID())

	// Absent values are NULL, not empty strings; routing_key falls back to the id.
	var nulls int
	require.NoError(t, s.DB.QueryRow(`SELECT num_nulls(occurred_at, published_at, next_attempt_at, lease_owner, lease_expires_at,
		last_failure_code, last_failure_detail, last_attempt_at, causation_id, tenant, partition_key, ordering_key,
		traceparent, tracestate, baggage, schema_subject, schema_version, content_type, message_type, aggregate_type,
		aggregate_id, aggregate_version, parked_at) FROM messaging_outbox WHERE message_id = $1`, bare.UUID).Scan(&nulls))
	require.Equal(t, 23, nulls)
	b := readRow(t, s.DB, bare.UUID)
	require.Equal(t, bare.UUID, b.RoutingKey, "routing_key is the message id without a partition key")
	require.Equal(t, "billing", b.Producer, "Config.Producer fills the producer column")
	require.Equal(t, "wm-corr", b.CorrelationID, "watermill's correlation_id fills correlation_id")
	require.Empty(t, b.Headers)
	bm, err := envelope.ToMessage(b, envelope.Options{})
	require.NoError(t, err)
	require.Equal(t, b.CreatedAt.UTC().Format(time.RFC3339Nano), bm.Metadata.Get(envelope.KeyOccurredAt), "occurred_at falls back to created_at")
}

func TestNastyHeaderValuesRoundTripThroughTheDatabase(t *testing.T) {
	s := newSchema(t)
	headers := map[string]string{
		"trailing-backslash": `C:\path\`,
		"only-backslash":     `\`,
		"quotes":             `say "hi" 'there'`,
		"control":            "tab\tnl\ncr\rbell\x07esc\x1b\x7f",
		"emoji":              "🚀💥👩‍👩‍👧",
		"non-ascii":          "Grüße, 日本語, עברית",
		"json-looking":       `{"a":[1,2],"b":null}`,
		"escape-looking":     `\u0000 \n \"`,
		"array-syntax":       `{NULL,"x"}`,
		"":                   "",
	}
	delete(headers, "") // empty names are refused; tested with the refusals
	headers["ключ \"с\" \\ кавычками"] = "value"
	m := newMsg(t, "p")
	for k, v := range headers {
		m.Metadata.Set(k, v)
	}
	envelope.SetCausationID(m, `cause\`)
	tx := begin(t, s.DB, nil)
	pub, err := publisher.New(tx, publisher.Config{}, nil)
	require.NoError(t, err)
	require.NoError(t, pub.Publish("t", m))
	require.NoError(t, tx.Commit())

	r := readRow(t, s.DB, m.UUID)
	require.Equal(t, headers, r.Headers)
	require.Equal(t, `cause\`, r.CausationID)
	var trailing string
	require.NoError(t, s.DB.QueryRow(`SELECT headers->>'trailing-backslash' FROM messaging_outbox WHERE message_id = $1`, m.UUID).Scan(&trailing))
	require.Equal(t, `C:\path\`, trailing, "stored as real jsonb, readable by operators' SQL")
}

// TestRefusalsWriteNothing: each bad input is refused with its code, and no
// message of the refused call (not even the valid one before it) is written.
func TestRefusalsWriteNothing(t *testing.T) {
	s := newSchema(t)
	cases := []struct {
		name  string
		topic string
		bad   func() *message.Message
		want  error
	}{
		{"empty topic", "", func() *message.Message { return newMsg(t, "x") }, outbox.ErrTopicRequired},
		{"empty message id", "t", func() *message.Message { return message.NewMessage("", nil) }, outbox.ErrMessageIDRequired},
		{"nil message", "t", func() *message.Message { return nil }, outbox.ErrMessageIDRequired},
		{"message id too long", "t", func() *message.Message {
			return message.NewMessage(strings.Repeat("a", envelope.MaxMessageIDLength+1), nil)
		}, outbox.ErrMessageIDTooLong},
		{"unknown msg.* key", "t", func() *message.Message {
			m := newMsg(t, "x")
			m.Metadata.Set("msg.priority", "high")
			return m
		}, outbox.ErrReservedHeader},
		{"NUL in header value", "t", func() *message.Message {
			m := newMsg(t, "x")
			m.Metadata.Set("k", "a\x00b")
			return m
		}, outbox.ErrInvalidHeader},
		{"NUL in header name", "t", func() *message.Message {
			m := newMsg(t, "x")
			m.Metadata.Set("k\x00", "v")
			return m
		}, outbox.ErrInvalidHeader},
		{"invalid UTF-8 in header value", "t", func() *message.Message {
			m := newMsg(t, "x")
			m.Metadata.Set("k", "\xff\xfe")
			return m
		}, outbox.ErrInvalidHeader},
		{"invalid UTF-8 in header name", "t", func() *message.Message {
			m := newMsg(t, "x")
			m.Metadata.Set("\xc3\x28", "v")
			return m
		}, outbox.ErrInvalidHeader},
		{"empty header name", "t", func() *message.Message {
			m := newMsg(t, "x")
			m.Metadata.Set("", "v")
			return m
		}, outbox.ErrInvalidHeader},
		{"NUL in canonical field", "t", func() *message.Message {
			m := newMsg(t, "x")
			envelope.SetCausationID(m, "a\x00")
			return m
		}, outbox.ErrInvalidHeader},
		{"NUL in topic", "t\x00", func() *message.Message { return newMsg(t, "x") }, outbox.ErrInvalidHeader},
		{"invalid tenant", "t", func() *message.Message {
			m := newMsg(t, "x")
			envelope.SetTenant(m, "Acme Corp")
			return m
		}, outbox.ErrInvalidTenant},
		{"unparsable occurred_at", "t", func() *message.Message {
			m := newMsg(t, "x")
			m.Metadata.Set(envelope.KeyOccurredAt, "yesterday")
			return m
		}, outbox.ErrInvalidMetadata},
		{"unparsable aggregate_version", "t", func() *message.Message {
			m := newMsg(t, "x")
			m.Metadata.Set(envelope.KeyAggregateVersion, "v9")
			return m
		}, outbox.ErrInvalidMetadata},
		// Issue 21: text that outboxctl prints and relays log is printable.
		{"ESC in topic", "orders\x1b[2J", func() *message.Message { return newMsg(t, "x") }, publisher.ErrControlCharacter},
		{"newline in topic", "orders\nmsg=forged", func() *message.Message { return newMsg(t, "x") }, publisher.ErrControlCharacter},
		{"C1 control in topic", "orders\u009b", func() *message.Message { return newMsg(t, "x") }, publisher.ErrControlCharacter},
		{"BEL in correlation id", "t", func() *message.Message {
			m := newMsg(t, "x")
			m.Metadata.Set(envelope.KeyCorrelationID, "\x1b]0;owned\x07")
			return m
		}, publisher.ErrControlCharacter},
		{"newline in ordering key", "t", func() *message.Message {
			m := newMsg(t, "x")
			m.Metadata.Set(envelope.KeyOrderingKey, "a\nb")
			return m
		}, publisher.ErrControlCharacter},
		{"ESC in message id", "t", func() *message.Message { return message.NewMessage("id\x1b[2J", nil) }, publisher.ErrControlCharacter},
		{"topic over the default length", strings.Repeat("t", publisher.DefaultMaxDestinationLength+1), func() *message.Message { return newMsg(t, "x") }, publisher.ErrDestinationTooLong},
		{"payload over the default limit", "t", func() *message.Message {
			return message.NewMessage(randomID(t), make([]byte, publisher.DefaultMaxPayloadBytes+1))
		}, publisher.ErrPayloadTooLarge},
		{"headers over the default limit", "t", func() *message.Message {
			m := newMsg(t, "x")
			m.Metadata.Set("big", strings.Repeat("h", publisher.DefaultMaxHeaderBytes))
			return m
		}, publisher.ErrHeadersTooLarge},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tx := begin(t, s.DB, nil)
			pub, err := publisher.New(tx, publisher.Config{}, nil)
			require.NoError(t, err)
			err = pub.Publish(tc.topic, newMsg(t, "valid"), tc.bad())
			require.ErrorIs(t, err, tc.want)
			var oe *outbox.Error
			require.ErrorAs(t, err, &oe)
			// The refusal happened before any SQL: the transaction is still
			// usable and committing it stores nothing.
			require.NoError(t, tx.Commit())
			require.Zero(t, s.Count(t, ""))
		})
	}

	t.Run("same id twice in one call", func(t *testing.T) {
		tx := begin(t, s.DB, nil)
		pub, err := publisher.New(tx, publisher.Config{}, nil)
		require.NoError(t, err)
		a := newMsg(t, "a")
		err = pub.Publish("t", a, newMsg(t, "b"), message.NewMessage(a.UUID, []byte("again")))
		require.ErrorIs(t, err, outbox.ErrDuplicateMessageID)
		require.NoError(t, tx.Commit(), "refused before any SQL, so the transaction is intact")
		require.Zero(t, s.Count(t, ""))
	})
}

func TestDuplicateAcrossCallsIsRefusedByTheDatabase(t *testing.T) {
	s := newSchema(t)
	first := newMsg(t, "first")
	require.NoError(t, publisher.InTx(context.Background(), s.DB, publisher.Config{}, func(_ context.Context, _ *sql.Tx, pub *publisher.Publisher) error {
		return pub.Publish("t", first)
	}))

	tx := begin(t, s.DB, nil)
	pub, err := publisher.New(tx, publisher.Config{}, nil)
	require.NoError(t, err)
	err = pub.Publish("t", newMsg(t, "other"), message.NewMessage(first.UUID, []byte("second")))
	require.ErrorIs(t, err, outbox.ErrDuplicateMessageID)
	// PostgreSQL aborted the caller's transaction: nothing more can happen in
	// it, and committing does not store the other message.
	err = pub.Publish("t", newMsg(t, "later"))
	require.ErrorIs(t, err, outbox.ErrTransactionRequired, "25P02 in_failed_sql_transaction")
	require.Error(t, tx.Commit())
	require.Equal(t, 1, s.Count(t, ""))
	var payload []byte
	require.NoError(t, s.DB.QueryRow(`SELECT payload FROM messaging_outbox WHERE message_id = $1`, first.UUID).Scan(&payload))
	require.Equal(t, "first", string(payload), "the stored row is never overwritten")
}

func TestConcurrentPublishCloseTwiceAndPublishAfterClose(t *testing.T) {
	s := newSchema(t)
	tx := begin(t, s.DB, nil)
	pub, err := publisher.New(tx, publisher.Config{}, nil)
	require.NoError(t, err)

	const goroutines, each = 16, 10
	var wg sync.WaitGroup
	errs := make(chan error, goroutines*each)
	for range goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range each {
				errs <- pub.Publish("t", newMsg(t, "x"), newMsg(t, "y"))
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	// Close races nothing: concurrent closers and publishers under -race.
	var cw sync.WaitGroup
	for range 4 {
		cw.Add(2)
		go func() { defer cw.Done(); require.NoError(t, pub.Close()) }()
		go func() {
			defer cw.Done()
			if err := pub.Publish("t", newMsg(t, "late")); err != nil {
				require.ErrorIs(t, err, outbox.ErrPublisherClosed)
			}
		}()
	}
	cw.Wait()
	require.NoError(t, pub.Close(), "Close is idempotent")
	late := newMsg(t, "after close")
	require.ErrorIs(t, pub.Publish("t", late), outbox.ErrPublisherClosed)
	require.NoError(t, tx.Commit())
	require.Zero(t, s.Count(t, "message_id = $1", late.UUID))
	require.GreaterOrEqual(t, s.Count(t, ""), goroutines*each*2)
}

func firstID(t *testing.T, db *sql.DB) string {
	t.Helper()
	var id string
	require.NoError(t, db.QueryRow(`SELECT message_id FROM messaging_outbox ORDER BY seq LIMIT 1`).Scan(&id))
	return id
}

func TestPublishUsesTheFirstMessageContext(t *testing.T) {
	s := newSchema(t)
	tx := begin(t, s.DB, nil)
	pub, err := publisher.New(tx, publisher.Config{}, nil)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	m := newMsg(t, "x")
	m.SetContext(ctx)
	err = pub.Publish("t", m, newMsg(t, "y"))
	require.ErrorIs(t, err, context.Canceled)
	require.NoError(t, tx.Rollback())
	require.Zero(t, s.Count(t, ""))
}

// A Publisher not built by New, NewOnTx or InTx has no transaction: Publish
// refuses it with a code instead of dereferencing a nil *sql.Tx.
func TestZeroValuePublisherIsRefusedWithoutPanicking(t *testing.T) {
	var zero publisher.Publisher
	require.ErrorIs(t, zero.Publish("t", newMsg(t, "x")), outbox.ErrTransactionRequired)
	require.ErrorIs(t, zero.Publish("t", newMsg(t, "a"), newMsg(t, "b")), outbox.ErrTransactionRequired)
	require.ErrorIs(t, zero.Publish("t"), outbox.ErrTransactionRequired, "no messages: still no transaction")
	require.NoError(t, zero.Close())
	require.ErrorIs(t, zero.Publish("t", newMsg(t, "x")), outbox.ErrPublisherClosed)
}

func TestKeyUnkeyedByTopicKeysOnlyTheUnkeyedMessages(t *testing.T) {
	s := newSchema(t)
	publish := func(cfg publisher.Config, topic string, msgs ...*message.Message) error {
		tx := begin(t, s.DB, nil)
		pub, err := publisher.New(tx, cfg, nil)
		require.NoError(t, err)
		if err := pub.Publish(topic, msgs...); err != nil {
			require.NoError(t, tx.Rollback())
			return err
		}
		return tx.Commit()
	}
	unkeyed, keyed, single := newMsg(t, "a"), newMsg(t, "b"), newMsg(t, "c")
	envelope.SetOrderingKey(keyed, "order-7")
	require.NoError(t, publish(publisher.Config{KeyUnkeyedByTopic: true}, "orders.paid", unkeyed, keyed))
	require.NoError(t, publish(publisher.Config{KeyUnkeyedByTopic: true}, "orders.shipped", single))
	require.Equal(t, "orders.paid", readRow(t, s.DB, unkeyed.UUID).OrderingKey, "an unkeyed message is keyed by its topic")
	require.Equal(t, "order-7", readRow(t, s.DB, keyed.UUID).OrderingKey, "a message's own key is kept")
	require.Equal(t, "orders.shipped", readRow(t, s.DB, single.UUID).OrderingKey, "the one-row statement too")

	off := newMsg(t, "d")
	require.NoError(t, publish(publisher.Config{}, "orders.paid", off))
	require.Empty(t, readRow(t, s.DB, off.UUID).OrderingKey, "off by default")

	// A topic the ordering key index cannot hold is refused before anything is written.
	long := strings.Repeat("t", envelope.MaxOrderingKeyLength+1)
	err := publish(publisher.Config{KeyUnkeyedByTopic: true, MaxDestinationLength: -1}, long, newMsg(t, "e"))
	require.ErrorIs(t, err, publisher.ErrDestinationTooLong)
	require.Contains(t, err.Error(), "KeyUnkeyedByTopic")
	require.Equal(t, 4, s.Count(t, ""))
}
