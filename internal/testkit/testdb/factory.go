package testdb

import (
	"cmp"
	"context"
	"database/sql"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/fencedoutbox/watermill-outbox/envelope"
)

// Execer is what the factory writes through: *sql.DB, *sql.Tx and *sql.Conn
// all satisfy it.
type Execer interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
}

// OutboxRow is one row for [InsertRows]: an envelope.Row plus the columns
// set by SQL expression. Build it with [Row].
type OutboxRow struct {
	row envelope.Row
	sql map[string]string
}

// RowOption adjusts one row of the factory.
type RowOption func(*OutboxRow)

// SQL sets column to the SQL expression expr, overriding the Row's field:
// SQL("created_at", "now() - interval '2 days'"), SQL("next_attempt_at",
// "'infinity'"), SQL("headers", `'{"a": "b"}'::jsonb`). expr is trusted
// test SQL, spliced into the statement as written. column must be an
// insertable messaging_outbox column.
func SQL(column, expr string) RowOption {
	return func(o *OutboxRow) {
		if o.sql == nil {
			o.sql = map[string]string{}
		}
		o.sql[column] = expr
	}
}

// Row builds one row for [InsertRows] from r and opts.
func Row(r envelope.Row, opts ...RowOption) OutboxRow {
	o := OutboxRow{row: r}
	for _, opt := range opts {
		opt(&o)
	}
	return o
}

// InsertRow writes one messaging_outbox row built from r and opts, and fails
// the test if the row is invalid or the database refuses it. It is the row
// factory: tests write outbox rows from an envelope.Row instead of
// hand-written INSERTs that drift from the schema (River's testfactory in
// this project's words). Any status and any column can be written; the zero
// value of a field means "not set", so the column takes its default:
//
//   - message_id: a random "row-…" id; destination: "orders"; payload: "{}"
//     (a nil Payload; an empty non-nil one is stored empty)
//   - status: PENDING; headers: {} (a nil or empty map); attempts and
//     lease_token: 0; created_at: now(); seq: the identity sequence
//   - every other text column NULL for "" (so ordering_key is NULL, never an
//     empty string), every other time column NULL for the zero time
//
// Rows are valid by construction where the schema ties columns together: a
// PUBLISHED row without PublishedAt gets published_at = now(), a FAILED or
// EXHAUSTED row without ParkedAt gets parked_at = now(), and a row that sets
// published_at or parked_at for a status the CHECKs refuse fails the test
// before it reaches the database. A non-zero Seq is written with OVERRIDING
// SYSTEM VALUE. RoutingKey is a generated column: it is not written, and a
// Row that sets it (as envelope.ToRow does) must agree with the column's
// rule (PartitionKey, else MessageID).
//
// A value a Row cannot hold ('infinity', now() - interval '1 hour', a jsonb
// literal) is given with [SQL], which sets the column to a trusted SQL
// expression and overrides the Row's field. Rows meant to break the schema
// (bad input, constraint tests) are still written by hand: the factory only
// writes rows the schema accepts.
func InsertRow(t testing.TB, db Execer, r envelope.Row, opts ...RowOption) {
	t.Helper()
	InsertRows(t, db, Row(r, opts...))
}

// InsertRows writes rows in one INSERT statement, so they share one
// transaction and one now(), as a hand-written multi-row VALUES list does,
// and take seq in the order given. A column any row sets is listed; the
// rows that do not set it write DEFAULT. Rows needing more than the
// protocol's 65,535 bound values are split into several statements, in
// order (pass a *sql.Tx to keep them in one transaction). It fails the test
// if a row is invalid or the database refuses a statement.
func InsertRows(t testing.TB, db Execer, rows ...OutboxRow) {
	t.Helper()
	q, args, err := insertStatement(rows)
	if err != nil {
		t.Fatalf("testdb: %v", err)
	}
	if len(args) > maxBoundValues && len(rows) > 1 {
		InsertRows(t, db, rows[:len(rows)/2]...)
		InsertRows(t, db, rows[len(rows)/2:]...)
		return
	}
	if _, err := db.ExecContext(context.Background(), q, args...); err != nil {
		if len(q) > 2000 {
			q = q[:2000] + "…"
		}
		t.Fatalf("testdb: insert %d outbox row(s): %v\n%s", len(rows), err, q)
	}
}

// maxBoundValues is the most parameters one statement may bind (the wire
// protocol counts them in 16 bits).
const maxBoundValues = 65535

// outboxColumns lists the insertable columns of messaging_outbox in table
// order, each with its value in a Row (nil when not set). routing_key and
// created_at_utc are generated and absent.
var outboxColumns = []struct {
	name  string
	value func(r envelope.Row) (any, error)
}{
	{"message_id", func(r envelope.Row) (any, error) { return r.MessageID, nil }},
	{"destination", func(r envelope.Row) (any, error) { return r.Destination, nil }},
	{"payload", func(r envelope.Row) (any, error) { return r.Payload, nil }},
	{"headers", func(r envelope.Row) (any, error) {
		if len(r.Headers) == 0 {
			return nil, nil
		}
		h, err := envelope.EncodeHeaders(r.Headers)
		if err != nil {
			return nil, err
		}
		return string(h), nil
	}},
	{"status", func(r envelope.Row) (any, error) { return text(string(r.Status)), nil }},
	{"seq", func(r envelope.Row) (any, error) { return nonZero(r.Seq), nil }},
	{"created_at", func(r envelope.Row) (any, error) { return stamp(r.CreatedAt), nil }},
	{"occurred_at", func(r envelope.Row) (any, error) { return stamp(r.OccurredAt), nil }},
	{"published_at", func(r envelope.Row) (any, error) { return stamp(r.PublishedAt), nil }},
	{"attempts", func(r envelope.Row) (any, error) { return nonZero(int64(r.Attempts)), nil }},
	{"next_attempt_at", func(r envelope.Row) (any, error) { return stamp(r.NextAttemptAt), nil }},
	{"lease_owner", func(r envelope.Row) (any, error) { return text(r.LeaseOwner), nil }},
	{"lease_token", func(r envelope.Row) (any, error) { return nonZero(r.LeaseToken), nil }},
	{"lease_expires_at", func(r envelope.Row) (any, error) { return stamp(r.LeaseExpiresAt), nil }},
	{"last_failure_code", func(r envelope.Row) (any, error) { return text(r.LastFailureCode), nil }},
	{"last_failure_detail", func(r envelope.Row) (any, error) { return text(r.LastFailureDetail), nil }},
	{"last_attempt_at", func(r envelope.Row) (any, error) { return stamp(r.LastAttemptAt), nil }},
	{"producer", func(r envelope.Row) (any, error) { return text(r.Producer), nil }},
	{"correlation_id", func(r envelope.Row) (any, error) { return text(r.CorrelationID), nil }},
	{"causation_id", func(r envelope.Row) (any, error) { return text(r.CausationID), nil }},
	{"tenant", func(r envelope.Row) (any, error) { return text(r.Tenant), nil }},
	{"partition_key", func(r envelope.Row) (any, error) { return text(r.PartitionKey), nil }},
	{"ordering_key", func(r envelope.Row) (any, error) { return text(r.OrderingKey), nil }},
	{"traceparent", func(r envelope.Row) (any, error) { return text(r.Traceparent), nil }},
	{"tracestate", func(r envelope.Row) (any, error) { return text(r.Tracestate), nil }},
	{"baggage", func(r envelope.Row) (any, error) { return text(r.Baggage), nil }},
	{"schema_subject", func(r envelope.Row) (any, error) { return text(r.SchemaSubject), nil }},
	{"schema_version", func(r envelope.Row) (any, error) { return text(r.SchemaVersion), nil }},
	{"content_type", func(r envelope.Row) (any, error) { return text(r.ContentType), nil }},
	{"message_type", func(r envelope.Row) (any, error) { return text(r.MessageType), nil }},
	{"aggregate_type", func(r envelope.Row) (any, error) { return text(r.AggregateType), nil }},
	{"aggregate_id", func(r envelope.Row) (any, error) { return text(r.AggregateID), nil }},
	{"aggregate_version", func(r envelope.Row) (any, error) {
		if r.AggregateVersion == nil {
			return nil, nil
		}
		return *r.AggregateVersion, nil
	}},
	{"parked_at", func(r envelope.Row) (any, error) { return stamp(r.ParkedAt), nil }},
}

func text(s string) any {
	if s == "" {
		return nil
	}
	return s
}

func stamp(t time.Time) any {
	if t.IsZero() {
		return nil
	}
	return t
}

func nonZero(n int64) any {
	if n == 0 {
		return nil
	}
	return n
}

// complete fills the defaults of o and checks it against the CHECKs that
// tie columns together, so a test learns what to change before the
// database answers with a constraint name.
func (o OutboxRow) complete() (envelope.Row, map[string]string, error) {
	r := o.row
	exprs := make(map[string]string, len(o.sql)+2)
	for c, e := range o.sql {
		exprs[c] = e
	}
	if r.MessageID == "" && exprs["message_id"] == "" {
		r.MessageID = "row-" + randomHex(6)
	}
	if r.Destination == "" && exprs["destination"] == "" {
		r.Destination = "orders"
	}
	if r.Payload == nil && exprs["payload"] == "" {
		r.Payload = []byte("{}")
	}
	if _, ok := exprs["routing_key"]; ok || exprs["created_at_utc"] != "" {
		return r, nil, fmt.Errorf("row %q: routing_key and created_at_utc are generated columns: they cannot be written", r.MessageID)
	}
	if r.RoutingKey != "" && r.RoutingKey != cmp.Or(r.PartitionKey, r.MessageID) {
		return r, nil, fmt.Errorf("row %q: RoutingKey %q is not what the generated routing_key column will hold (PartitionKey, else MessageID): leave it empty", r.MessageID, r.RoutingKey)
	}
	for c := range exprs {
		if !insertable(c) {
			return r, nil, fmt.Errorf("row %q: SQL(%q, ...): not an insertable messaging_outbox column", r.MessageID, c)
		}
	}
	if _, raw := exprs["status"]; raw {
		return r, exprs, nil // the database checks what SQL writes
	}
	if r.Status == "" {
		r.Status = envelope.StatusPending
	}
	if !r.Status.Valid() {
		return r, nil, fmt.Errorf("row %q: status %q is not one of the six states (write it with SQL(\"status\", ...) to test the refusal)", r.MessageID, r.Status)
	}
	published := !r.PublishedAt.IsZero() || exprs["published_at"] != ""
	parked := !r.ParkedAt.IsZero() || exprs["parked_at"] != ""
	switch {
	case r.Status == envelope.StatusPublished && !published:
		exprs["published_at"] = "now()"
	case r.Status != envelope.StatusPublished && published:
		return r, nil, fmt.Errorf("row %q: published_at is set only with PUBLISHED (messaging_outbox_published_at_check), status is %s", r.MessageID, r.Status)
	}
	switch {
	case r.Status.Parked() && !parked:
		exprs["parked_at"] = "now()"
	case !r.Status.Parked() && parked:
		return r, nil, fmt.Errorf("row %q: parked_at is set only with FAILED or EXHAUSTED (messaging_outbox_parked_at_check), status is %s", r.MessageID, r.Status)
	}
	return r, exprs, nil
}

func insertable(column string) bool {
	for _, c := range outboxColumns {
		if c.name == column {
			return true
		}
	}
	return false
}

// insertStatement builds the INSERT for rows: the columns any row sets, one
// VALUES tuple per row with DEFAULT where a row does not set a column.
func insertStatement(rows []OutboxRow) (string, []any, error) {
	if len(rows) == 0 {
		return "", nil, fmt.Errorf("InsertRows: no rows")
	}
	type cell struct {
		expr  string // SQL expression, or "" for a bound value
		value any    // bound value when expr is ""; nil for not set
	}
	grid := make([][]cell, len(rows))
	used := make([]bool, len(outboxColumns))
	for i, o := range rows {
		r, exprs, err := o.complete()
		if err != nil {
			return "", nil, err
		}
		grid[i] = make([]cell, len(outboxColumns))
		for j, c := range outboxColumns {
			if e, ok := exprs[c.name]; ok {
				grid[i][j] = cell{expr: e}
				used[j] = true
				continue
			}
			v, err := c.value(r)
			if err != nil {
				return "", nil, fmt.Errorf("row %q: %s: %w", r.MessageID, c.name, err)
			}
			if v != nil {
				grid[i][j] = cell{value: v}
				used[j] = true
			}
		}
	}
	var b strings.Builder
	b.WriteString("INSERT INTO messaging_outbox (")
	sep := ""
	for j, c := range outboxColumns {
		if used[j] {
			b.WriteString(sep + c.name)
			sep = ", "
		}
	}
	b.WriteString(")")
	for j, c := range outboxColumns {
		if used[j] && c.name == "seq" { // an identity column GENERATED ALWAYS
			b.WriteString(" OVERRIDING SYSTEM VALUE")
		}
	}
	b.WriteString(" VALUES ")
	var args []any
	for i := range grid {
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteString("(")
		sep = ""
		for j, c := range outboxColumns {
			if !used[j] {
				continue
			}
			b.WriteString(sep)
			sep = ", "
			switch x := grid[i][j]; {
			case x.expr != "":
				b.WriteString(x.expr)
			case x.value == nil:
				b.WriteString("DEFAULT")
			default:
				args = append(args, x.value)
				fmt.Fprintf(&b, "$%d", len(args))
				if c.name == "headers" {
					b.WriteString("::jsonb")
				}
			}
		}
		b.WriteString(")")
	}
	return b.String(), args, nil
}
