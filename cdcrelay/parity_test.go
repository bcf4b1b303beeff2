package cdcrelay_test

import (
	"context"
	"database/sql"
	"math/rand/v2"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/cdcrelay"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/await"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// parityRows are inserted with raw SQL, every column of each row in the
// INSERT itself (nothing is updated afterwards), so what the slot streams
// and what the table holds are the same values. Together they give every
// envelope.Row field a set value in some row and, for every nullable or
// defaulted column, the NULL or default in another; the test checks that
// coverage instead of trusting this comment. published_at and parked_at
// follow status (messaging_outbox_published_at_check, _parked_at_check).
var parityRows = []map[string]any{
	{ // every nullable column set that a PENDING row may have
		"message_id": "full-pending", "destination": "orders.v1", "payload": []byte("\x00\x01binary\xff\\x"),
		"headers": `{"x-app": "a \"quoted\" \\ value\\", "x-unicode": "zoë ✓ 𝄞", "x-empty": "", "x-newline": "a\nb\tc"}`,
		"status":  "PENDING", "created_at": "2024-02-03 04:05:06.123456+00", "occurred_at": "2024-02-03 09:35:06.5+05:30",
		"attempts": 3, "next_attempt_at": "2024-02-03 04:06:00+00", "lease_owner": "relay-1", "lease_token": 41,
		"lease_expires_at": "2024-02-03 04:07:00.000001+00", "last_failure_code": "BROKER_TIMEOUT",
		"last_failure_detail": "deadline exceeded\nafter 5s: \"quoted\" \\ back", "last_attempt_at": "2024-02-03 04:05:59.999999+00",
		"producer": "orders-svc", "correlation_id": "corr-1", "causation_id": "cause-1", "tenant": "acme.eu_1",
		"partition_key": "order-9", "ordering_key": "order-9", "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
		"tracestate": "congo=t61rcWkgMzE", "baggage": "userId=alice,serverNode=DF%2028", "schema_subject": "orders-value",
		"schema_version": "3", "content_type": "application/json", "message_type": "OrderPaid", "aggregate_type": "Order",
		"aggregate_id": "order-9", "aggregate_version": 7,
	},
	{ // every nullable column NULL, every default taken (created_at is now()), empty payload
		"message_id": "bare", "destination": "orders", "payload": []byte{},
	},
	{ // ordering key without partition key: the routing key falls back to the id
		"message_id": "01HV6Z4Q8W3M5N7P9R2T4V6X8Z", "destination": "orders", "payload": []byte("in flight"), "status": "IN_FLIGHT",
		"headers": `{"x-trace": "1"}`, "attempts": 1, "lease_owner": "relay-2", "lease_token": int64(9223372036854775807),
		"lease_expires_at": "9999-12-31 23:59:59.999999+00", "ordering_key": "customer-1", "last_attempt_at": "2024-02-03 04:05:06+00",
		"aggregate_type": "Customer", "aggregate_id": "customer-1", "aggregate_version": 0,
	},
	{
		"message_id": "published", "destination": "payments", "payload": []byte(`{"amount": 10}`), "status": "PUBLISHED",
		"published_at": "2024-02-03 04:05:07+00", "partition_key": "clé-ü", "attempts": 1, "tenant": "globex",
		"content_type": "application/json", "message_type": "PaymentTaken", "occurred_at": "1969-12-31 23:59:59.999999+00",
	},
	{
		"message_id": "ambiguous", "destination": "orders", "payload": []byte("?"), "status": "AMBIGUOUS",
		"attempts": 2, "next_attempt_at": "2024-02-03 04:10:00+00", "last_failure_code": "PUBLISH_UNCONFIRMED",
		"last_failure_detail": "the broker did not answer", "created_at": "1969-12-31 23:59:59.999999+00",
		"occurred_at": "0001-01-01 00:00:01+00", "aggregate_version": -1, "causation_id": "ambiguous-cause",
	},
	{
		"message_id": "failed", "destination": "orders", "payload": []byte("rejected"), "status": "FAILED",
		"parked_at": "2024-02-03 04:05:08.25+00", "attempts": 1, "last_failure_code": "PUBLISH_REJECTED",
		"last_failure_detail": "Schéma refusé: « champ manquant »", "producer": "billing", "schema_subject": "billing-value", "schema_version": "12",
	},
	{ // a large payload, stored out of line (TOAST), and the integer extremes
		"message_id": "exhausted", "destination": "orders", "payload": largePayload(), "status": "EXHAUSTED",
		"parked_at": "2024-02-03 04:05:09+00", "attempts": int64(2147483647), "aggregate_version": int64(-9223372036854775808),
		"headers": `{"x-big": "` + strings.Repeat("é", 3000) + `"}`, "baggage": "k=v", "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00",
	},
}

func largePayload() []byte {
	rng := rand.New(rand.NewPCG(1, 2)) // incompressible, so it is stored out of line
	b := make([]byte, 200_000)
	for i := range b {
		b[i] = byte(rng.Uint32())
	}
	return b
}

// insertRow writes one row with raw SQL. The column names are this file's
// constants; the values are bound.
func insertRow(t *testing.T, db *sql.DB, row map[string]any) {
	t.Helper()
	names := make([]string, 0, len(row))
	for k := range row {
		names = append(names, k)
	}
	slices.Sort(names)
	params, args := make([]string, len(names)), make([]any, len(names))
	for i, n := range names {
		params[i], args[i] = "$"+strconv.Itoa(i+1), row[n]
	}
	_, err := db.Exec(`INSERT INTO messaging_outbox (`+strings.Join(names, ", ")+`) VALUES (`+strings.Join(params, ", ")+`)`, args...)
	require.NoError(t, err, row["message_id"])
}

type decoded struct {
	row envelope.Row
	err error
}

// streamInserts reads n inserts from the relay's slot the way Run does: the
// relay's own replication connection settings and START_REPLICATION options,
// pgoutput parsed by pglogrepl, and the relay's tuple decoding. It confirms
// nothing, so the slot still holds every insert afterwards.
func streamInserts(t *testing.T, r *cdcrelay.Relay, slot string, n int) map[string]decoded {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgconn.ConnectConfig(ctx, r.ReplicationConfig())
	require.NoError(t, err)
	defer func() { _ = conn.Close(context.Background()) }()
	require.NoError(t, pglogrepl.StartReplication(ctx, conn, slot, 0, r.StartOptions()))

	rels := map[uint32]*pglogrepl.RelationMessage{}
	out := map[string]decoded{}
	for inserts := 0; inserts < n; {
		raw, err := conn.ReceiveMessage(ctx)
		require.NoError(t, err, "%d of %d inserts received", inserts, n)
		if er, ok := raw.(*pgproto3.ErrorResponse); ok {
			require.NoError(t, pgconn.ErrorResponseToPgError(er))
		}
		cd, ok := raw.(*pgproto3.CopyData)
		if !ok || len(cd.Data) == 0 || cd.Data[0] != pglogrepl.XLogDataByteID {
			continue // keepalives
		}
		xld, err := pglogrepl.ParseXLogData(cd.Data[1:])
		require.NoError(t, err)
		lm, err := pglogrepl.Parse(xld.WALData)
		require.NoError(t, err)
		switch m := lm.(type) {
		case *pglogrepl.RelationMessage:
			rels[m.RelationID] = m
		case *pglogrepl.InsertMessage:
			rel := rels[m.RelationID]
			require.NotNil(t, rel, "insert before its relation message")
			var id string
			for i, c := range rel.Columns {
				if c.Name == "message_id" {
					id = string(m.Tuple.Columns[i].Data)
				}
			}
			row, err := cdcrelay.DecodeInsert(rel, m.Tuple)
			out[id] = decoded{row, err}
			inserts++
		}
	}
	return out
}

// requireSameRow compares every field of envelope.Row by reflection, so a
// field added to Row later is compared without editing this test. Times are
// compared as instants: lib/pq returns them in the session's zone, the
// decoder in UTC.
func requireSameRow(t *testing.T, want, got envelope.Row) {
	t.Helper()
	wv, gv := reflect.ValueOf(want), reflect.ValueOf(got)
	for i := range wv.NumField() {
		name := wv.Type().Field(i).Name
		w, g := wv.Field(i).Interface(), gv.Field(i).Interface()
		if wt, ok := w.(time.Time); ok {
			require.Truef(t, wt.Equal(g.(time.Time)), "row %s, field %s: ScanRow %s, cdcrelay %s", want.MessageID, name, wt, g)
			continue
		}
		require.Equalf(t, w, g, "row %s, field %s", want.MessageID, name)
	}
}

// empty is a field's "absent" value: NULL for nullable columns, the column
// default for the others.
func empty(v reflect.Value) bool {
	switch v.Kind() {
	case reflect.Slice, reflect.Map:
		return v.Len() == 0
	}
	return v.IsZero()
}

// TestDecodeAgreesWithScanRow: the rows the relay decodes from the
// replication stream are, field by field, the rows envelope.ScanRow (the
// polling forwarder's reader) reads from the table, and both refuse a status
// outside the six states with the same code.
func TestDecodeAgreesWithScanRow(t *testing.T) {
	base := testdb.Logical(t)
	e := newEnv(t, base)
	cfg := e.config()
	out := &recorder{}
	r, err := cdcrelay.New(cfg, out, nil)
	require.NoError(t, err)
	require.NoError(t, r.Prepare(context.Background())) // the slot holds what is inserted from now on

	for _, row := range parityRows {
		insertRow(t, e.s.DB, row)
	}
	// A status the code does not know can only come from a table whose CHECK
	// was dropped or widened (a newer schema, hand-made SQL).
	_, err = e.s.DB.Exec(`ALTER TABLE messaging_outbox DROP CONSTRAINT messaging_outbox_status_check`)
	require.NoError(t, err)
	insertRow(t, e.s.DB, map[string]any{"message_id": "unknown-status", "destination": "orders", "payload": []byte("u"), "status": "BOGUS"})

	streamed := streamInserts(t, r, cfg.SlotName, len(parityRows)+1)

	rows, err := e.s.DB.Query(`SELECT ` + envelope.SelectColumns + ` FROM messaging_outbox ORDER BY seq`)
	require.NoError(t, err)
	scanned := map[string]decoded{}
	var order []string
	for rows.Next() {
		row, err := envelope.ScanRow(rows)
		scanned[row.MessageID] = decoded{row, err}
		order = append(order, row.MessageID)
	}
	require.NoError(t, rows.Err())
	require.NoError(t, rows.Close())
	require.Len(t, scanned, len(parityRows)+1)
	require.Len(t, streamed, len(scanned), "one insert streamed per row")

	for _, id := range order[:len(parityRows)] {
		want, got := scanned[id], streamed[id]
		require.NoError(t, want.err, id)
		require.NoError(t, got.err, id)
		requireSameRow(t, want.row, got.row)
	}

	// The rows cover every field both ways, or the comparison above proves
	// less than it seems to.
	never := map[string]bool{"MessageID": true, "Destination": true, "Status": true, "Seq": true, "CreatedAt": true, "RoutingKey": true}
	typ := reflect.TypeFor[envelope.Row]()
	for i := range typ.NumField() {
		name := typ.Field(i).Name
		var set, unset bool
		for _, id := range order[:len(parityRows)] {
			if empty(reflect.ValueOf(scanned[id].row).Field(i)) {
				unset = true
			} else {
				set = true
			}
		}
		require.True(t, set, "no parity row sets %s", name)
		require.True(t, unset || never[name], "no parity row leaves %s NULL/default", name)
	}
	var statuses []envelope.Status
	for _, id := range order[:len(parityRows)] {
		statuses = append(statuses, scanned[id].row.Status)
	}
	for _, s := range []envelope.Status{envelope.StatusPending, envelope.StatusInFlight, envelope.StatusPublished, envelope.StatusAmbiguous, envelope.StatusFailed, envelope.StatusExhausted} {
		require.Contains(t, statuses, s)
	}

	bogusScan, bogusStream := scanned["unknown-status"], streamed["unknown-status"]
	require.ErrorIs(t, bogusScan.err, outbox.ErrCorruptRow)
	require.ErrorIs(t, bogusStream.err, outbox.ErrCorruptRow)
	require.Equal(t, outbox.CodeOf(bogusScan.err), outbox.CodeOf(bogusStream.err))
	require.ErrorContains(t, bogusStream.err, `"BOGUS"`)

	// The relay itself: the known rows still to deliver become the messages
	// the polling relay builds from ScanRow's rows (rows already PUBLISHED
	// or parked FAILED/EXHAUSTED are skipped, as the forwarder skips them),
	// then the unknown status stops it.
	var deliverable []string
	for _, id := range order[:len(parityRows)] {
		switch scanned[id].row.Status {
		case envelope.StatusPending, envelope.StatusInFlight, envelope.StatusAmbiguous:
			deliverable = append(deliverable, id)
		}
	}
	require.NotEmpty(t, deliverable)
	e.enableCDC(t)
	require.Eventually(t, func() bool { return !e.slotActive(t) }, await.Patience(t), 10*time.Millisecond)
	err = r.Run(context.Background())
	require.ErrorIs(t, err, outbox.ErrCorruptRow)
	require.ErrorContains(t, err, "unknown-status")
	require.Equal(t, deliverable, out.ids())
	for i, m := range out.got {
		want, err := envelope.ToMessage(scanned[deliverable[i]].row, envelope.Options{})
		require.NoError(t, err)
		require.Equal(t, want.UUID, m.UUID)
		require.Equal(t, []byte(want.Payload), []byte(m.Payload), want.UUID)
		require.Equal(t, want.Metadata, m.Metadata, want.UUID)
	}
	require.NoError(t, r.Close())
}
