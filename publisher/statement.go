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

// insertRows writes a whole batch in one statement. Every per-message value
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
	n := len(msgs)
	var (
		ids, producers, corr, caus, tenants, pkeys, okeys = make(textArray, n), make(textArray, n), make(textArray, n), make(textArray, n), make(textArray, n), make(textArray, n), make(textArray, n)
		tps, tss, bgs, ssubs, svers, cts, mts, aggTs      = make(textArray, n), make(textArray, n), make(textArray, n), make(textArray, n), make(textArray, n), make(textArray, n), make(textArray, n), make(textArray, n)
		aggIDs, aggVs, occurred, headers                  = make(textArray, n), make(textArray, n), make(textArray, n), make(textArray, n)
		payloads                                          = make(pq.ByteaArray, n)
		seen                                              = make(map[string]int, n)
		plain                                             = make([]string, n)
	)
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
		h, err := envelope.EncodeHeaders(r.Headers)
		if err != nil {
			return Statement{}, err
		}
		plain[i] = r.MessageID
		ids[i] = sql.NullString{String: r.MessageID, Valid: true}
		payloads[i] = r.Payload
		headers[i] = sql.NullString{String: string(h), Valid: true}
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
	args := []any{topic, ids, payloads, headers, producers, occurred,
		corr, caus, tenants, pkeys, okeys,
		tps, tss, bgs, ssubs, svers,
		cts, mts, aggTs, aggIDs, aggVs}
	query := insertRows
	if cfg.Notify {
		query = insertRowsAndNotify
		args = append(args, cfg.NotifyChannel)
	}
	return Statement{SQL: query, Args: args, IDs: plain}, nil
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
