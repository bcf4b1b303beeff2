package main

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// outboxRows is every column of every outbox row, in seq order: what an
// execution that touched nothing leaves exactly as it was.
func outboxRows(t *testing.T, s *testdb.Schema) string {
	t.Helper()
	var rows string
	require.NoError(t, s.DB.QueryRow(`SELECT coalesce(string_agg(row_to_json(o)::text, E'\n' ORDER BY o.seq), '') FROM messaging_outbox o`).Scan(&rows))
	return rows
}

// docs/ERRORS.md: JOURNAL_APPROVAL_EXCEEDED, `Redrive`, `Purge` (exit 3):
// more rows match the approved row set now than were approved (a row parked
// before the approval committed after it); the error gives both counts;
// nothing was touched. Here through the CLI: an approved redrive of 3 parked
// rows meets a fourth row of the approved set, parked (backdated to before
// the approval) by a transaction that committed after it.
func TestRedriveRefusesMoreRowsThanApproved(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	// 'late' is PENDING at approval time and has a lower seq than the parked
	// rows: inside the approved seq range, but not matching yet.
	testdb.InsertRows(t, s.DB, testdb.Row(envelope.Row{MessageID: "late", Destination: "orders", Payload: []byte("x")}))
	var parked []testdb.OutboxRow
	for _, id := range []string{"fa-1", "fa-2", "fa-3"} {
		parked = append(parked, testdb.Row(envelope.Row{MessageID: id, Destination: "orders", Payload: []byte("x"),
			Status: envelope.StatusFailed, Attempts: 1, LastFailureCode: "REJECTED"}, testdb.SQL("parked_at", "now() - interval '1 hour'")))
	}
	testdb.InsertRows(t, s.DB, parked...)
	filter := []string{"--status", "failed", "--destination", "orders"}

	digest := dryRunDigest(t, s, "redrive", filter...)
	r := db(t, s, append([]string{"--json", "redrive", "--ticket", "CHG-77", "--expect-digest", digest, "--approve"}, filter...)...)
	requireCode(t, r, 0)
	var ap map[string]any
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &ap), r.stdout)
	require.EqualValues(t, 3, ap["approved_count"])

	// Parked "before" the approval, committed after it: the approved row set
	// now holds 4 rows.
	exec1(t, s.DB, `UPDATE messaging_outbox SET status = 'FAILED', parked_at = now() - interval '30 minutes', attempts = 1,
	   last_failure_code = 'REJECTED' WHERE message_id = 'late'`)
	before := outboxRows(t, s)
	require.Equal(t, 4, s.Count(t, "status = 'FAILED'"))

	exe := append([]string{"redrive", "--ticket", "CHG-77", "--expect-digest", digest}, filter...)
	r = db(t, s, exe...)
	requireCode(t, r, ExitRefused)
	require.Contains(t, r.stderr, "JOURNAL_APPROVAL_EXCEEDED")
	require.Contains(t, r.stderr, "code: JOURNAL_APPROVAL_EXCEEDED")
	require.Contains(t, r.stderr, "4 rows match the approved row set now, 3 were approved", "the error gives both counts")
	require.Equal(t, before, outboxRows(t, s), "nothing was redriven")

	// The same refusal as JSON.
	r = db(t, s, append([]string{"--json"}, exe...)...)
	requireCode(t, r, ExitRefused)
	var e map[string]any
	require.NoError(t, json.Unmarshal([]byte(r.stderr), &e), r.stderr)
	require.Equal(t, "JOURNAL_APPROVAL_EXCEEDED", e["code"])
	require.Equal(t, before, outboxRows(t, s), "nothing was redriven")

	// The refusal did not use up the ticket: with the extra row gone, the
	// approved 3 are redriven.
	exec1(t, s.DB, `DELETE FROM messaging_outbox WHERE message_id = 'late'`)
	r = db(t, s, exe...)
	requireCode(t, r, 0)
	require.Contains(t, r.stdout, "redrive complete under ticket CHG-77: 3 of 3 items")
	require.Equal(t, 3, s.Count(t, "status = 'PENDING' AND parked_at IS NULL AND message_id LIKE 'fa-%'"))
}
