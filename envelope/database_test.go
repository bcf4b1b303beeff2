package envelope_test

import (
	"context"
	"strings"
	"testing"

	"github.com/lib/pq"
	"github.com/lib/pq/pqerror"
	"github.com/stretchr/testify/require"

	outbox "github.com/fencedoutbox/watermill-outbox"
	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// TestTenantRuleAgreesWithTheDatabase inserts every case with a raw INSERT,
// bypassing Go entirely, and checks the CHECK constraint and ValidateTenant
// give the same answer; the database's refusal is SQLSTATE 23514.
func TestTenantRuleAgreesWithTheDatabase(t *testing.T) {
	s := testdb.New(t)
	s.DB.SetMaxOpenConns(2)
	cases := []string{
		"a", "0", "acme", "acme-eu", "acme.eu_1", "a-", "9lives", strings.Repeat("a", 64),
		"", "A", "Acme", "-acme", ".acme", "_acme", "acme corp", "acme/eu", strings.Repeat("a", 65),
		"acmé", "acme\n", "\nacme", "acme!", "ＡＣＭＥ",
	}
	ctx := context.Background()
	for i, tenant := range cases {
		goOK := envelope.ValidateTenant(tenant) == nil
		if !goOK {
			require.ErrorIs(t, envelope.ValidateTenant(tenant), outbox.ErrInvalidTenant)
		}
		_, err := s.DB.ExecContext(ctx, `INSERT INTO messaging_outbox (message_id, destination, payload, tenant) VALUES ($1, 't', '', $2)`,
			"tenant-"+string(rune('a'+i)), tenant)
		if goOK {
			require.NoError(t, err, "tenant %q", tenant)
			continue
		}
		require.Error(t, err, "the database must refuse tenant %q", tenant)
		pqErr := pq.As(err, pqerror.CheckViolation)
		require.NotNil(t, pqErr, "tenant %q: %v", tenant, err)
		require.Equal(t, "messaging_outbox_tenant_check", pqErr.Constraint)
	}
	// NULL is allowed by the schema and means "no tenant"; Go stores "" as NULL.
	_, err := s.DB.ExecContext(ctx, `INSERT INTO messaging_outbox (message_id, destination, payload) VALUES ('no-tenant', 't', '')`)
	require.NoError(t, err)
}

// TestHeaderCodecThroughJSONB stores EncodeHeaders output in the real jsonb
// column and decodes what PostgreSQL gives back.
func TestHeaderCodecThroughJSONB(t *testing.T) {
	s := testdb.New(t)
	s.DB.SetMaxOpenConns(2)
	h := map[string]string{}
	for i, v := range nastyStrings {
		if textOK(v) {
			h["k"+string(rune('A'+i))+v] = v
		}
	}
	enc, err := envelope.EncodeHeaders(h)
	require.NoError(t, err)
	_, err = s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload, headers) VALUES ('h', 't', '', $1::jsonb)`, string(enc))
	require.NoError(t, err)
	r, err := envelope.ScanRow(s.DB.QueryRow(`SELECT ` + envelope.SelectColumns + ` FROM messaging_outbox WHERE message_id = 'h'`))
	require.NoError(t, err)
	require.Equal(t, h, r.Headers)

	// What the codec refuses, jsonb could not hold either.
	_, err = envelope.EncodeHeaders(map[string]string{"k": "a\x00b"})
	require.ErrorIs(t, err, outbox.ErrInvalidHeader)
	_, err = s.DB.Exec(`SELECT '{"k":"a\u0000b"}'::jsonb`)
	require.Error(t, err, "PostgreSQL refuses \\u0000 in jsonb")
}

// TestScanRowReportsCorruptRows: a row the envelope cannot decode is returned
// with OUTBOX_CORRUPT_ROW and its identity, so a relay can park it.
func TestScanRowReportsCorruptRows(t *testing.T) {
	s := testdb.New(t)
	s.DB.SetMaxOpenConns(2)
	_, err := s.DB.Exec(`INSERT INTO messaging_outbox (message_id, destination, payload, headers) VALUES ('bad', 't', '', '{"n": 1}')`)
	require.NoError(t, err)
	r, err := envelope.ScanRow(s.DB.QueryRow(`SELECT ` + envelope.SelectColumns + ` FROM messaging_outbox WHERE message_id = 'bad'`))
	require.ErrorIs(t, err, outbox.ErrCorruptRow)
	require.Equal(t, "bad", r.MessageID)
	require.Equal(t, "t", r.Destination)
}

// TestRowScannerReadsEachRowAfresh: one RowScanner over a result set gives
// every row exactly what ScanRow gives it alone; nothing of a fuller row
// (optional columns, headers, the aggregate version, the payload's memory)
// carries into the next.
func TestRowScannerReadsEachRowAfresh(t *testing.T) {
	s := testdb.New(t)
	s.DB.SetMaxOpenConns(2)
	seven, nine := int64(7), int64(9)
	testdb.InsertRow(t, s.DB, envelope.Row{MessageID: "r1", Destination: "full", Payload: []byte("payload one"),
		Headers: map[string]string{"a": "1", "b": "2"}, Producer: "p", CorrelationID: "c", CausationID: "k", Tenant: "acme",
		PartitionKey: "pk", OrderingKey: "ok", Traceparent: "tp", Tracestate: "ts", Baggage: "bg", SchemaSubject: "ss",
		SchemaVersion: "sv", ContentType: "ct", MessageType: "mt", AggregateType: "at", AggregateID: "aid", AggregateVersion: &seven},
		testdb.SQL("occurred_at", "now() - interval '1 hour'"))
	testdb.InsertRow(t, s.DB, envelope.Row{MessageID: "r2", Destination: "bare", Payload: []byte{}})
	// A header value that is not a string: valid jsonb, a corrupt row to the envelope.
	testdb.InsertRow(t, s.DB, envelope.Row{MessageID: "r3", Destination: "corrupt", Payload: []byte("x")},
		testdb.SQL("headers", `'{"a":1}'`))
	testdb.InsertRow(t, s.DB, envelope.Row{MessageID: "r4", Destination: "again", Payload: []byte("payload four"), AggregateVersion: &nine})

	rows, err := s.DB.Query(`SELECT ` + envelope.SelectColumns + ` FROM messaging_outbox ORDER BY seq`)
	require.NoError(t, err)
	defer rows.Close()
	var rs envelope.RowScanner
	var got []envelope.Row
	for rows.Next() {
		r, err := rs.Scan(rows)
		if r.MessageID == "r3" {
			require.ErrorIs(t, err, outbox.ErrCorruptRow)
		} else {
			require.NoError(t, err)
		}
		got = append(got, r)
	}
	require.NoError(t, rows.Err())
	require.Len(t, got, 4)
	for _, r := range got {
		alone, _ := envelope.ScanRow(s.DB.QueryRow(`SELECT `+envelope.SelectColumns+` FROM messaging_outbox WHERE message_id = $1`, r.MessageID))
		require.Equal(t, alone, r, "row %s", r.MessageID)
	}
	require.Equal(t, int64(7), *got[0].AggregateVersion)
	require.Nil(t, got[1].AggregateVersion)
	require.Equal(t, int64(9), *got[3].AggregateVersion)
	got[0].Payload[0] = 'X'
	require.Equal(t, "payload four", string(got[3].Payload), "rows must not share payload memory")
}
