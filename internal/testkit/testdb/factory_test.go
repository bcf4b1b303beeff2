package testdb_test

import (
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

func readRow(t *testing.T, s *testdb.Schema, id string) envelope.Row {
	t.Helper()
	r, err := envelope.ScanRow(s.DB.QueryRow(`SELECT `+envelope.SelectColumns+` FROM messaging_outbox WHERE message_id = $1`, id))
	if err != nil {
		t.Fatalf("read %s: %v", id, err)
	}
	return r
}

// The defaults: a PENDING row with a generated id, destination "orders",
// payload "{}", no headers, NULL for every optional column.
func TestInsertRowDefaults(t *testing.T) {
	s := testdb.New(t)
	testdb.InsertRow(t, s.DB, envelope.Row{})
	var id string
	if err := s.DB.QueryRow(`SELECT message_id FROM messaging_outbox`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	r := readRow(t, s, id)
	if !strings.HasPrefix(r.MessageID, "row-") || r.Destination != "orders" || string(r.Payload) != "{}" ||
		r.Status != envelope.StatusPending || len(r.Headers) != 0 || r.Seq == 0 || r.CreatedAt.IsZero() {
		t.Fatalf("defaults: %+v", r)
	}
	if n := s.Count(t, `ordering_key IS NULL AND tenant IS NULL AND lease_owner IS NULL AND published_at IS NULL
		AND parked_at IS NULL AND occurred_at IS NULL AND aggregate_version IS NULL AND attempts = 0`); n != 1 {
		t.Fatalf("optional columns are not NULL")
	}
}

// Every column a Row holds is written and read back unchanged, for every
// status; the status's tied timestamp is filled in when not given.
func TestInsertRowAnyStatusAnyColumn(t *testing.T) {
	s := testdb.New(t)
	at := time.Date(2026, 1, 2, 3, 4, 5, 123456000, time.UTC)
	v := int64(7)
	for i, st := range []envelope.Status{envelope.StatusPending, envelope.StatusInFlight, envelope.StatusPublished,
		envelope.StatusAmbiguous, envelope.StatusFailed, envelope.StatusExhausted} {
		want := envelope.Row{
			MessageID: "m-" + string(st), Destination: "d", Payload: []byte("p"), Headers: map[string]string{"k": "v"},
			Status: st, Seq: int64(1000 + i), CreatedAt: at, OccurredAt: at, Attempts: 3, NextAttemptAt: at,
			LeaseOwner: "relay-1", LeaseToken: 42, LeaseExpiresAt: at, LastFailureCode: "C", LastFailureDetail: "detail",
			LastAttemptAt: at, Producer: "p", CorrelationID: "c", CausationID: "ca", Tenant: "t1", PartitionKey: "pk",
			OrderingKey: "ok", Traceparent: "tp", Tracestate: "ts", Baggage: "b", SchemaSubject: "ss", SchemaVersion: "sv",
			ContentType: "ct", MessageType: "mt", AggregateType: "at", AggregateID: "ai", AggregateVersion: &v,
		}
		testdb.InsertRow(t, s.DB, want)
		got := readRow(t, s, want.MessageID)
		if (st == envelope.StatusPublished) == got.PublishedAt.IsZero() || st.Parked() == got.ParkedAt.IsZero() {
			t.Fatalf("%s: published_at %v, parked_at %v", st, got.PublishedAt, got.ParkedAt)
		}
		got.PublishedAt, got.ParkedAt, want.RoutingKey = time.Time{}, time.Time{}, "pk"
		for _, p := range []*time.Time{&got.CreatedAt, &got.OccurredAt, &got.NextAttemptAt, &got.LeaseExpiresAt, &got.LastAttemptAt} {
			*p = p.UTC()
		}
		if *got.AggregateVersion != v {
			t.Fatalf("aggregate_version %d", *got.AggregateVersion)
		}
		got.AggregateVersion = &v
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("%s:\n got %+v\nwant %+v", st, got, want)
		}
	}
}

// Raw SQL for what a Row cannot hold, and one statement for many rows: the
// rows share now(), and a row without seq takes the sequence even when
// another row overrides it.
func TestInsertRowsSQLAndSharedStatement(t *testing.T) {
	s := testdb.New(t)
	testdb.InsertRows(t, s.DB,
		testdb.Row(envelope.Row{MessageID: "a", Seq: 500}),
		testdb.Row(envelope.Row{MessageID: "b", Status: envelope.StatusPublished}, testdb.SQL("created_at", "now() - interval '2 days'")),
		testdb.Row(envelope.Row{MessageID: "c", OrderingKey: ""}, testdb.SQL("next_attempt_at", "'infinity'"), testdb.SQL("headers", `'{"x": "y"}'::jsonb`)),
	)
	if n := s.Count(t, `message_id = 'a' AND seq = 500`); n != 1 {
		t.Fatal("seq not overridden")
	}
	if n := s.Count(t, `message_id = 'c' AND seq <> 500 AND next_attempt_at = 'infinity' AND headers = '{"x": "y"}' AND ordering_key IS NULL`); n != 1 {
		t.Fatal("row c")
	}
	if n := s.Count(t, `message_id = 'b' AND created_at < now() - interval '1 day' AND published_at = (SELECT created_at FROM messaging_outbox WHERE message_id = 'a')`); n != 1 {
		t.Fatal("row b: created_at from SQL, published_at = the statement's now()")
	}
}

// Rows past the protocol's bound-value limit go in several statements, in
// the order given.
func TestInsertRowsSplitsPastTheParameterLimit(t *testing.T) {
	s := testdb.New(t)
	rows := make([]testdb.OutboxRow, 0, 22000)
	for i := 1; i <= 22000; i++ { // 3 bound values a row: 66,000
		rows = append(rows, testdb.Row(envelope.Row{MessageID: fmt.Sprintf("m%05d", i)}))
	}
	testdb.InsertRows(t, s.DB, rows...)
	if n := s.Count(t, ""); n != 22000 {
		t.Fatalf("%d rows", n)
	}
	if n := testdb.QueryInt(t, s.DB, `SELECT count(*) FROM (SELECT message_id, row_number() OVER (ORDER BY seq) AS rn FROM messaging_outbox) x
		WHERE message_id <> 'm' || lpad(rn::text, 5, '0')`); n != 0 {
		t.Fatalf("%d rows out of seq order", n)
	}
}
