package publisher

import (
	"database/sql"
	"database/sql/driver"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/lib/pq"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
)

// insertRows writes a batch of two or more messages in one statement. Every per-message value
// travels as one array parameter and unnest turns the arrays back into rows,
// so the statement text is fixed whatever the batch size (one plan, no
// concatenated values) and a batch costs a single round trip. WITH
// ORDINALITY ... ORDER BY keeps seq in the order the messages were passed.
// The destination is the same for the whole call, so it is a scalar.
const insertRows = `INSERT INTO messaging_outbox (
    message_id, destination, payload, headers, producer, occurred_at,
    correlation_id, causation_id, tenant, partition_key, ordering_key,
    traceparent, tracestate, baggage, schema_subject, schema_version,
    content_type, message_type, aggregate_type, aggregate_id, aggregate_version)
SELECT u.message_id, $1::text, u.payload, u.headers, u.producer, u.occurred_at,
    u.correlation_id, u.causation_id, u.tenant, u.partition_key, u.ordering_key,
    u.traceparent, u.tracestate, u.baggage, u.schema_subject, u.schema_version,
    u.content_type, u.message_type, u.aggregate_type, u.aggregate_id, u.aggregate_version
FROM unnest($2::text[], $3::bytea[], $4::jsonb[], $5::text[], $6::timestamptz[],
    $7::text[], $8::text[], $9::text[], $10::text[], $11::text[],
    $12::text[], $13::text[], $14::text[], $15::text[], $16::text[],
    $17::text[], $18::text[], $19::text[], $20::text[], $21::bigint[])
    WITH ORDINALITY AS u(message_id, payload, headers, producer, occurred_at,
    correlation_id, causation_id, tenant, partition_key, ordering_key,
    traceparent, tracestate, baggage, schema_subject, schema_version,
    content_type, message_type, aggregate_type, aggregate_id, aggregate_version, ord)
ORDER BY u.ord`

// insertRowsAndNotify is insertRows plus the wake-up signal in the same
// statement: a data-modifying CTE always runs to completion, and pg_notify is
// queued in the caller's transaction (delivered on commit, dropped on
// rollback), so turning Notify on adds no round trip.
const insertRowsAndNotify = `WITH ins AS (` + insertRows + `
RETURNING 1)
SELECT pg_notify($22::text, '') WHERE EXISTS (SELECT 1 FROM ins)`

// insertOne is the statement for the common case of one message per call.
// Measured on PostgreSQL 15 (one business transaction storing one message,
// lib/pq): the unnest form costs about 520µs per statement against 290µs for
// a minimal 4-column INSERT, because the server parses and plans 21 array
// casts, an ordinality join and a sort every time (lib/pq uses the unnamed
// statement, so nothing is cached); this VALUES form costs about 390µs. It is
// still a fixed text: absent values are bound as NULL.
const insertOne = `INSERT INTO messaging_outbox (
    message_id, destination, payload, headers, producer, occurred_at,
    correlation_id, causation_id, tenant, partition_key, ordering_key,
    traceparent, tracestate, baggage, schema_subject, schema_version,
    content_type, message_type, aggregate_type, aggregate_id, aggregate_version)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20, $21)`

// insertOneAndNotify adds the wake-up signal to insertOne, in the same
// statement for the same reason as insertRowsAndNotify.
const insertOneAndNotify = `WITH ins AS (` + insertOne + `
RETURNING 1)
SELECT pg_notify($22::text, '') WHERE EXISTS (SELECT 1 FROM ins)`

// Statement is one fixed SQL text and its arguments, ready for ExecContext
// on a *sql.Tx (or any executor on a lib/pq connection).
type Statement struct {
	SQL  string
	Args []any
	// IDs are the message ids in the order they are inserted.
	IDs []string
}

// BuildInsert validates every message and returns the single statement that
// writes them all into messaging_outbox, converting each with
// envelope.ToRow(topic, msg, envelope.Options{Producer: cfg.Producer}).
// Nothing is sent to the database: a refusal here means no row of the batch
// can be written. Refusals are *outbox.Error with the codes of envelope.ToRow
// plus OUTBOX_DUPLICATE_MESSAGE_ID (the same id twice in msgs) and
// OUTBOX_INVALID_CONFIG. The watermill-sql schema adapters (sub-packages
// sqlv3 and sqlv4) are built on it.
func BuildInsert(topic string, msgs []*message.Message, cfg Config) (Statement, error) {
	const op = "publisher.Publish"
	if err := cfg.Validate(); err != nil {
		return Statement{}, err
	}
	cfg = cfg.withDefaults()
	if topic == "" {
		return Statement{}, outbox.Errorf(outbox.CodeTopicRequired, op, "topic must not be empty")
	}
	rows := make([]envelope.Row, len(msgs))
	headers := make([][]byte, len(msgs))
	ids := make([]string, len(msgs))
	seen := make(map[string]int, len(msgs))
	opts := envelope.Options{Producer: cfg.Producer}
	for i, msg := range msgs {
		r, err := envelope.ToRow(topic, msg, opts)
		if err != nil {
			return Statement{}, err
		}
		if j, dup := seen[r.MessageID]; dup {
			return Statement{}, outbox.Errorf(outbox.CodeDuplicateMessageID, op,
				"message id %q appears at positions %d and %d of the same call", r.MessageID, j, i)
		}
		seen[r.MessageID] = i
		if headers[i], err = envelope.EncodeHeaders(r.Headers); err != nil {
			return Statement{}, err
		}
		rows[i], ids[i] = r, r.MessageID
	}
	var st Statement
	if len(rows) == 1 {
		st = one(topic, rows[0], headers[0], cfg)
	} else {
		st = batch(topic, rows, headers, cfg)
	}
	st.IDs = ids
	return st, nil
}

func one(topic string, r envelope.Row, headers []byte, cfg Config) Statement {
	var occurred sql.NullTime
	if !r.OccurredAt.IsZero() {
		occurred = sql.NullTime{Time: r.OccurredAt, Valid: true}
	}
	var aggV sql.NullInt64
	if r.AggregateVersion != nil {
		aggV = sql.NullInt64{Int64: *r.AggregateVersion, Valid: true}
	}
	args := []any{r.MessageID, topic, r.Payload, string(headers), text(r.Producer), occurred,
		text(r.CorrelationID), text(r.CausationID), text(r.Tenant), text(r.PartitionKey), text(r.OrderingKey),
		text(r.Traceparent), text(r.Tracestate), text(r.Baggage), text(r.SchemaSubject), text(r.SchemaVersion),
		text(r.ContentType), text(r.MessageType), text(r.AggregateType), text(r.AggregateID), aggV}
	if cfg.Notify {
		return Statement{SQL: insertOneAndNotify, Args: append(args, cfg.NotifyChannel)}
	}
	return Statement{SQL: insertOne, Args: args}
}

func batch(topic string, rows []envelope.Row, headers [][]byte, cfg Config) Statement {
	n := len(rows)
	col := func() textArray { return make(textArray, n) }
	var (
		ids, hdrs, producers, occurred, corr, caus, tenants = col(), col(), col(), col(), col(), col(), col()
		pkeys, okeys, tps, tss, bgs, ssubs, svers           = col(), col(), col(), col(), col(), col(), col()
		cts, mts, aggTs, aggIDs, aggVs                      = col(), col(), col(), col(), col()
		payloads                                            = make(pq.ByteaArray, n)
	)
	for i, r := range rows {
		ids[i], payloads[i], hdrs[i] = text(r.MessageID), r.Payload, text(string(headers[i]))
		producers[i] = text(r.Producer)
		if !r.OccurredAt.IsZero() {
			occurred[i] = text(r.OccurredAt.Format(time.RFC3339Nano))
		}
		corr[i], caus[i], tenants[i] = text(r.CorrelationID), text(r.CausationID), text(r.Tenant)
		pkeys[i], okeys[i] = text(r.PartitionKey), text(r.OrderingKey)
		tps[i], tss[i], bgs[i] = text(r.Traceparent), text(r.Tracestate), text(r.Baggage)
		ssubs[i], svers[i], cts[i], mts[i] = text(r.SchemaSubject), text(r.SchemaVersion), text(r.ContentType), text(r.MessageType)
		aggTs[i], aggIDs[i] = text(r.AggregateType), text(r.AggregateID)
		if r.AggregateVersion != nil {
			aggVs[i] = text(strconv.FormatInt(*r.AggregateVersion, 10))
		}
	}
	args := []any{topic, ids, payloads, hdrs, producers, occurred,
		corr, caus, tenants, pkeys, okeys,
		tps, tss, bgs, ssubs, svers,
		cts, mts, aggTs, aggIDs, aggVs}
	if cfg.Notify {
		return Statement{SQL: insertRowsAndNotify, Args: append(args, cfg.NotifyChannel)}
	}
	return Statement{SQL: insertRows, Args: args}
}

// text maps "" to NULL: the envelope never stores an absent value as an
// empty string.
func text(s string) sql.NullString { return sql.NullString{String: s, Valid: s != ""} }

// textArray is a one-dimensional PostgreSQL array literal whose elements may
// be NULL (pq.StringArray cannot carry NULL). The statement casts it to the
// column's type (text[], jsonb[], timestamptz[], bigint[]).
type textArray []sql.NullString

// Value encodes the array literal: NULL unquoted, every other element
// double-quoted with backslash and double quote escaped, which is all the
// array input syntax requires. Values never contain NUL (the envelope refuses
// it before this point).
func (a textArray) Value() (driver.Value, error) {
	var b strings.Builder
	b.WriteByte('{')
	for i, e := range a {
		if i > 0 {
			b.WriteByte(',')
		}
		if !e.Valid {
			b.WriteString("NULL")
			continue
		}
		b.WriteByte('"')
		for j := 0; j < len(e.String); j++ {
			c := e.String[j]
			if c == '"' || c == '\\' {
				b.WriteByte('\\')
			}
			b.WriteByte(c)
		}
		b.WriteByte('"')
	}
	b.WriteByte('}')
	return b.String(), nil
}
