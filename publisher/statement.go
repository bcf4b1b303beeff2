package publisher

import (
	"database/sql"
	"math"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/lib/pq"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
)

// Statement variants. PostgreSQL parses, binds and plans every statement the
// publisher sends (lib/pq uses the unnamed statement, so nothing is cached),
// and that cost grows with the number of parameters: measured on PostgreSQL
// 15, the 21-parameter statement cost about 0.35 ms more per transaction than
// a 3-column one into the same table. Most messages fill only the identity,
// payload and headers, plus perhaps a producer, a correlation id and a trace
// context, so the publisher picks the narrowest of three fixed column sets
// that holds every non-NULL field of the batch:
//
//   - minimal: message_id, destination, payload, headers;
//   - common:  minimal + producer, occurred_at, correlation_id, causation_id,
//     traceparent, tracestate, baggage;
//   - full:    all 21 columns the envelope writes.
//
// A column left out is NULL either way (no column of messaging_outbox that
// the envelope writes has a default other than NULL), so the three variants
// store identical rows. The optional columns are ordered so that each
// variant's columns are a prefix of the next one's, and every text is a
// constant: the variant is chosen, never assembled from values.

// variant is how many optional columns (after message_id, destination,
// payload, headers) a statement carries.
type variant int

const (
	variantMinimal variant = 0
	variantCommon  variant = 7
	variantFull    variant = 17
)

// insertOne* write one message with VALUES (cheaper to plan than unnest for a
// single row: about 390µs against 520µs for the full column set).
const (
	// fullColumns are the columns the full variant writes (every statement
	// of it, with or without the ordering-key lock).
	fullColumns = `message_id, destination, payload, headers,
    producer, occurred_at, correlation_id, causation_id, traceparent, tracestate, baggage,
    tenant, partition_key, ordering_key, schema_subject, schema_version,
    content_type, message_type, aggregate_type, aggregate_id, aggregate_version`

	insertOneMinimal = `INSERT INTO messaging_outbox (message_id, destination, payload, headers)
VALUES ($1, $2, $3, $4)`
	insertOneCommon = `INSERT INTO messaging_outbox (message_id, destination, payload, headers,
    producer, occurred_at, correlation_id, causation_id, traceparent, tracestate, baggage)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)`
	insertOneFull = `INSERT INTO messaging_outbox (` + fullColumns + `)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20, $21)`
)

// insertRows* write two or more messages in one statement. Every per-message
// value travels as one array parameter and unnest turns the arrays back into
// rows, so the text is fixed whatever the batch size (no concatenated values)
// and a batch costs a single round trip. The payloads are the exception: they
// travel as one bytea, all of them end to end ($3), with each one's start
// and length as int4 arrays ($4, $5), and substring cuts them apart on the
// server. A bytea[] would carry each payload hex-encoded inside a quoted,
// backslash-escaped array literal that the server parses character by
// character; one bytea is a single hex string (1.12–1.48x the rows per second
// for 10 rows of 1 KB per transaction on a two-column table, measured side by
// side). WITH ORDINALITY ... ORDER BY keeps seq in the order the messages were
// passed. The destination is the same for the whole call, so it is a scalar
// ($1).
const (
	rowsPayload = `substring($3::bytea FROM u.payload_at FOR u.payload_len)`
	rowsOrder   = "\nORDER BY u.ord"

	insertRowsMinimal = `INSERT INTO messaging_outbox (message_id, destination, payload, headers)
SELECT u.message_id, $1::text, ` + rowsPayload + `, u.headers
FROM unnest($2::text[], $4::int4[], $5::int4[], $6::jsonb[])
    WITH ORDINALITY AS u(message_id, payload_at, payload_len, headers, ord)
ORDER BY u.ord`
	insertRowsCommon = `INSERT INTO messaging_outbox (message_id, destination, payload, headers,
    producer, occurred_at, correlation_id, causation_id, traceparent, tracestate, baggage)
SELECT u.message_id, $1::text, ` + rowsPayload + `, u.headers,
    u.producer, u.occurred_at, u.correlation_id, u.causation_id, u.traceparent, u.tracestate, u.baggage
FROM unnest($2::text[], $4::int4[], $5::int4[], $6::jsonb[],
    $7::text[], $8::timestamptz[], $9::text[], $10::text[], $11::text[], $12::text[], $13::text[])
    WITH ORDINALITY AS u(message_id, payload_at, payload_len, headers,
    producer, occurred_at, correlation_id, causation_id, traceparent, tracestate, baggage, ord)
ORDER BY u.ord`
	insertRowsFullHead = `INSERT INTO messaging_outbox (` + fullColumns + `)
SELECT u.message_id, $1::text, ` + rowsPayload + `, u.headers,
    u.producer, u.occurred_at, u.correlation_id, u.causation_id, u.traceparent, u.tracestate, u.baggage,
    u.tenant, u.partition_key, u.ordering_key, u.schema_subject, u.schema_version,
    u.content_type, u.message_type, u.aggregate_type, u.aggregate_id, u.aggregate_version
FROM unnest($2::text[], $4::int4[], $5::int4[], $6::jsonb[],
    $7::text[], $8::timestamptz[], $9::text[], $10::text[], $11::text[], $12::text[], $13::text[],
    $14::text[], $15::text[], $16::text[], $17::text[], $18::text[],
    $19::text[], $20::text[], $21::text[], $22::text[], $23::bigint[])
    WITH ORDINALITY AS u(message_id, payload_at, payload_len, headers,
    producer, occurred_at, correlation_id, causation_id, traceparent, tracestate, baggage,
    tenant, partition_key, ordering_key, schema_subject, schema_version,
    content_type, message_type, aggregate_type, aggregate_id, aggregate_version, ord)`
	insertRowsFull = insertRowsFullHead + rowsOrder
)

// The *AndNotify forms add the wake-up signal in the same statement: a
// data-modifying CTE always runs to completion, and pg_notify is queued in the
// caller's transaction (delivered on commit, dropped on rollback), so turning
// Notify on adds no round trip. The channel is the parameter after the
// variant's last one.
const (
	notifyHead = `WITH ins AS (`

	insertOneMinimalAndNotify  = notifyHead + insertOneMinimal + "\nRETURNING 1)\nSELECT pg_notify($5::text, '') WHERE EXISTS (SELECT 1 FROM ins)"
	insertOneCommonAndNotify   = notifyHead + insertOneCommon + "\nRETURNING 1)\nSELECT pg_notify($12::text, '') WHERE EXISTS (SELECT 1 FROM ins)"
	insertOneFullAndNotify     = notifyHead + insertOneFull + "\nRETURNING 1)\nSELECT pg_notify($22::text, '') WHERE EXISTS (SELECT 1 FROM ins)"
	insertRowsMinimalAndNotify = notifyHead + insertRowsMinimal + "\nRETURNING 1)\nSELECT pg_notify($7::text, '') WHERE EXISTS (SELECT 1 FROM ins)"
	insertRowsCommonAndNotify  = notifyHead + insertRowsCommon + "\nRETURNING 1)\nSELECT pg_notify($14::text, '') WHERE EXISTS (SELECT 1 FROM ins)"
	insertRowsFullAndNotify    = notifyHead + insertRowsFull + "\nRETURNING 1)\nSELECT pg_notify($24::text, '') WHERE EXISTS (SELECT 1 FROM ins)"
)

// The ordering-key lock (Config.LockOrderingKeys): the statement takes a
// transaction-scoped advisory lock on each ordering key it writes before any
// row gets its seq, so a second transaction writing the same key waits for the
// first to end and its rows get later seqs: seq order is commit order within
// a key. The lock is taken inside the INSERT (no round trip), in key order
// within one statement. The full variant is the only one with ordering keys.
const (
	// orderingLockSpace is the first half of every advisory lock key the
	// publisher takes (the second is hashtext of the ordering key), so its
	// locks do not collide with an application's single-key advisory locks.
	orderingLockSpace = "1869574002"

	insertOneFullLocked = `INSERT INTO messaging_outbox (` + fullColumns + `)
SELECT $1::text, $2::text, $3::bytea, $4::jsonb, $5::text, $6::timestamptz, $7::text, $8::text, $9::text, $10::text,
    $11::text, $12::text, $13::text, $14::text, $15::text, $16::text, $17::text, $18::text, $19::text, $20::text, $21::bigint
FROM (SELECT pg_advisory_xact_lock(` + orderingLockSpace + `, hashtext($14::text))) AS ordering_lock`
	// insertRowsFullLocked is insertRowsFull joined with the locks on its
	// distinct ordering keys ($16), taken before the rows are formed.
	insertRowsFullLocked = insertRowsFullHead + `,
    (SELECT count(pg_advisory_xact_lock(` + orderingLockSpace + `, hashtext(k.key)))
       FROM (SELECT DISTINCT key FROM unnest($16::text[]) AS key WHERE key IS NOT NULL ORDER BY key) AS k) AS ordering_lock` + rowsOrder

	insertOneFullLockedAndNotify  = notifyHead + insertOneFullLocked + "\nRETURNING 1)\nSELECT pg_notify($22::text, '') WHERE EXISTS (SELECT 1 FROM ins)"
	insertRowsFullLockedAndNotify = notifyHead + insertRowsFullLocked + "\nRETURNING 1)\nSELECT pg_notify($24::text, '') WHERE EXISTS (SELECT 1 FROM ins)"
)

// lockedStatements[one or batch][notify]: the full variant with the
// ordering-key lock.
var lockedStatements = [2][2]string{
	{insertRowsFullLocked, insertRowsFullLockedAndNotify}, {insertOneFullLocked, insertOneFullLockedAndNotify},
}

// statements[one or batch][notify] by variant.
var statements = map[variant][2][2]string{
	variantMinimal: {{insertRowsMinimal, insertRowsMinimalAndNotify}, {insertOneMinimal, insertOneMinimalAndNotify}},
	variantCommon:  {{insertRowsCommon, insertRowsCommonAndNotify}, {insertOneCommon, insertOneCommonAndNotify}},
	variantFull:    {{insertRowsFull, insertRowsFullAndNotify}, {insertOneFull, insertOneFullAndNotify}},
}

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
// (OUTBOX_TOPIC_REQUIRED, OUTBOX_MESSAGE_ID_REQUIRED,
// OUTBOX_MESSAGE_ID_TOO_LONG, OUTBOX_RESERVED_HEADER, OUTBOX_INVALID_HEADER,
// OUTBOX_INVALID_TENANT, OUTBOX_INVALID_METADATA) plus
// OUTBOX_DESTINATION_TOO_LONG, OUTBOX_PAYLOAD_TOO_LARGE and
// OUTBOX_HEADERS_TOO_LARGE (the Config limits; OUTBOX_PAYLOAD_TOO_LARGE also
// for two or more messages whose payloads add up to 2 GiB - 1 byte or more),
// OUTBOX_CONTROL_CHARACTER (in the topic, a message id or a canonical
// field), OUTBOX_DUPLICATE_MESSAGE_ID (the same id twice in msgs) and
// OUTBOX_INVALID_CONFIG (cfg fails Validate). The watermill-sql schema
// adapters (sub-packages sqlv3 and sqlv4) are built on it.
//
// The statement carries only the columns the batch fills (one of three fixed
// column sets, see the variant constants), so its text depends on which
// optional fields the messages set, never on their values or their number.
func BuildInsert(topic string, msgs []*message.Message, cfg Config) (Statement, error) {
	if err := cfg.Validate(); err != nil {
		return Statement{}, err
	}
	return buildInsert(topic, msgs, cfg.withDefaults())
}

// buildInsert is BuildInsert for a configuration already validated and
// defaulted (Publisher.New did both once, so Publish does not repeat them).
func buildInsert(topic string, msgs []*message.Message, cfg Config) (Statement, error) {
	const op = "publisher.Publish"
	if topic == "" {
		return Statement{}, outbox.Errorf(outbox.CodeTopicRequired, op, "topic must not be empty")
	}
	lim := cfg.limits()
	if err := checkTopic(topic, lim); err != nil {
		return Statement{}, err
	}
	if cfg.KeyUnkeyedByTopic && len(topic) > envelope.MaxOrderingKeyLength {
		return Statement{}, outbox.Errorf(CodeDestinationTooLong, op,
			"topic is %d bytes; with Config.KeyUnkeyedByTopic it is the ordering key of unkeyed messages, which is at most %d bytes (it is indexed): use a shorter topic or turn KeyUnkeyedByTopic off",
			len(topic), envelope.MaxOrderingKeyLength)
	}
	rows := make([]envelope.Row, len(msgs))
	headers := make([][]byte, len(msgs))
	ids := make([]string, len(msgs))
	seen := make(map[string]int, len(msgs))
	opts := envelope.Options{Producer: cfg.Producer}
	v := variantMinimal
	for i, msg := range msgs {
		if err := checkMessage(msg, i, lim); err != nil {
			return Statement{}, err
		}
		r, err := envelope.ToRow(topic, msg, opts)
		if err != nil {
			return Statement{}, err
		}
		if cfg.KeyUnkeyedByTopic && r.OrderingKey == "" {
			r.OrderingKey = topic
		}
		if err := checkRow(r, i); err != nil {
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
		v = max(v, variantOf(r))
	}
	var st Statement
	if len(rows) == 1 {
		st = one(topic, rows[0], headers[0], v, cfg)
	} else {
		var err error
		if st, err = batch(topic, rows, headers, v, cfg); err != nil {
			return Statement{}, err
		}
	}
	st.IDs = ids
	return st, nil
}

// variantOf is the narrowest column set that holds every non-NULL field of r.
func variantOf(r envelope.Row) variant {
	if r.Tenant != "" || r.PartitionKey != "" || r.OrderingKey != "" || r.SchemaSubject != "" ||
		r.SchemaVersion != "" || r.ContentType != "" || r.MessageType != "" || r.AggregateType != "" ||
		r.AggregateID != "" || r.AggregateVersion != nil {
		return variantFull
	}
	if r.Producer != "" || !r.OccurredAt.IsZero() || r.CorrelationID != "" || r.CausationID != "" ||
		r.Traceparent != "" || r.Tracestate != "" || r.Baggage != "" {
		return variantCommon
	}
	return variantMinimal
}

func pick(v variant, single, notify, lock bool) string {
	s := statements[v]
	if lock && v == variantFull {
		s = lockedStatements
	}
	i, j := 0, 0
	if single {
		i = 1
	}
	if notify {
		j = 1
	}
	return s[i][j]
}

// optional returns the optional fields of r in column order (the order of
// the full variant); a variant sends the first v of them.
func optional(r envelope.Row) [variantFull]string {
	return [variantFull]string{
		r.Producer, "", r.CorrelationID, r.CausationID, r.Traceparent, r.Tracestate, r.Baggage,
		r.Tenant, r.PartitionKey, r.OrderingKey, r.SchemaSubject, r.SchemaVersion,
		r.ContentType, r.MessageType, r.AggregateType, r.AggregateID, "",
	}
}

// Positions in optional() that are not plain text.
const (
	occurredAtField       = 1
	aggregateVersionField = 16
)

func one(topic string, r envelope.Row, headers []byte, v variant, cfg Config) Statement {
	args := make([]any, 0, 4+int(v)+1)
	args = append(args, r.MessageID, topic, r.Payload, string(headers))
	opt := optional(r)
	for i := range int(v) {
		switch i {
		case occurredAtField:
			var occurred sql.NullTime
			if !r.OccurredAt.IsZero() {
				occurred = sql.NullTime{Time: r.OccurredAt, Valid: true}
			}
			args = append(args, occurred)
		case aggregateVersionField:
			var aggV sql.NullInt64
			if r.AggregateVersion != nil {
				aggV = sql.NullInt64{Int64: *r.AggregateVersion, Valid: true}
			}
			args = append(args, aggV)
		default:
			args = append(args, text(opt[i]))
		}
	}
	if cfg.Notify {
		args = append(args, cfg.NotifyChannel)
	}
	return Statement{SQL: pick(v, true, cfg.Notify, cfg.LockOrderingKeys && r.OrderingKey != ""), Args: args}
}

// maxBatchPayloadBytes is the most payload bytes a batch statement can
// carry: batch addresses each payload by its 1-based start and its length
// as int4, so the start after every payload must still fit in an int32.
const maxBatchPayloadBytes = math.MaxInt32 - 1

// checkBatchPayloads refuses n payloads of total bytes together, too large
// for batch's int4 offsets.
func checkBatchPayloads(n int, total int64) error {
	if total > maxBatchPayloadBytes {
		return outbox.Errorf(CodePayloadTooLarge, "publisher.Publish",
			"the %d payloads of this call total %d bytes; one call carries at most %d: publish them in several calls",
			n, total, int64(maxBatchPayloadBytes))
	}
	return nil
}

func batch(topic string, rows []envelope.Row, headers [][]byte, v variant, cfg Config) (Statement, error) {
	n := len(rows)
	var size int64
	for _, r := range rows {
		size += int64(len(r.Payload))
	}
	if err := checkBatchPayloads(n, size); err != nil {
		return Statement{}, err
	}
	ids, hdrs := make(textArray, n), make(textArray, n)
	payloads := make([]byte, 0, size)
	at, lens := make(pq.Int32Array, n), make(pq.Int32Array, n)
	cols := make([]textArray, v)
	for c := range cols {
		cols[c] = make(textArray, n)
	}
	for i, r := range rows {
		ids[i], hdrs[i] = text(r.MessageID), text(string(headers[i]))
		at[i], lens[i] = int32(len(payloads)+1), int32(len(r.Payload)) // substring counts from 1
		payloads = append(payloads, r.Payload...)
		opt := optional(r)
		for c := range cols {
			switch c {
			case occurredAtField:
				if !r.OccurredAt.IsZero() {
					cols[c][i] = text(r.OccurredAt.Format(time.RFC3339Nano))
				}
			case aggregateVersionField:
				if r.AggregateVersion != nil {
					cols[c][i] = text(strconv.FormatInt(*r.AggregateVersion, 10))
				}
			default:
				cols[c][i] = text(opt[c])
			}
		}
	}
	args := make([]any, 0, 6+int(v)+1)
	args = append(args, topic, ids, payloads, at, lens, hdrs)
	for _, c := range cols {
		args = append(args, c)
	}
	if cfg.Notify {
		args = append(args, cfg.NotifyChannel)
	}
	keyed := false
	for _, r := range rows {
		keyed = keyed || r.OrderingKey != ""
	}
	return Statement{SQL: pick(v, false, cfg.Notify, cfg.LockOrderingKeys && keyed), Args: args}, nil
}
