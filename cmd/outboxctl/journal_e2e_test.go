package main

import (
	"encoding/json"
	"regexp"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/envelope"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

func seedParked(t *testing.T, s *testdb.Schema) {
	t.Helper()
	var exhausted []testdb.OutboxRow
	for g := 1; g <= 30; g++ {
		dest := "orders"
		if g > 25 {
			dest = "billing"
		}
		exhausted = append(exhausted, testdb.Row(envelope.Row{MessageID: "ex-" + strconv.Itoa(g), Destination: dest, Payload: []byte("x"),
			Status: envelope.StatusExhausted, Attempts: 10, LastFailureCode: "PUBLISH_TIMEOUT", Tenant: "acme"}))
	}
	testdb.InsertRows(t, s.DB, exhausted...)
	failed := envelope.Row{Destination: "orders", Payload: []byte("x"), Status: envelope.StatusFailed, Attempts: 1, LastFailureCode: "REJECTED"}
	fa1, fa2 := failed, failed
	fa1.MessageID, fa2.MessageID = "fa-1", "fa-2"
	testdb.InsertRows(t, s.DB, testdb.Row(fa1), testdb.Row(fa2),
		testdb.Row(envelope.Row{MessageID: "pending-1", Destination: "orders", Payload: []byte("x")}))
}

// insertExhausted writes n EXHAUSTED rows prefix1..prefixn in one statement,
// parked at the SQL expression parkedAt.
func insertExhausted(t *testing.T, s *testdb.Schema, prefix string, n int, parkedAt string) {
	t.Helper()
	rows := make([]testdb.OutboxRow, 0, n)
	for g := 1; g <= n; g++ {
		rows = append(rows, testdb.Row(envelope.Row{MessageID: prefix + strconv.Itoa(g), Destination: "orders", Payload: []byte("x"),
			Status: envelope.StatusExhausted, Attempts: 10, LastFailureCode: "PUBLISH_TIMEOUT"}, testdb.SQL("parked_at", parkedAt)))
	}
	testdb.InsertRows(t, s.DB, rows...)
}

var digestRe = regexp.MustCompile(`(?m)^digest\s+([0-9a-f]{64})$`)

func TestRedriveDryRunThenExactlyOnce(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	seedParked(t, s)
	filter := []string{"--status", "exhausted", "--destination", "orders", "--tenant", "acme", "--failure-code", "PUBLISH_TIMEOUT"}

	// Dry run: plan, count and digest; nothing changes.
	r := db(t, s, append([]string{"redrive", "--dry-run"}, filter...)...)
	requireCode(t, r, 0)
	require.Regexp(t, `(?m)^operation\s+redrive$`, r.stdout)
	require.Regexp(t, `(?m)^matching\s+25$`, r.stdout)
	m := digestRe.FindStringSubmatch(r.stdout)
	require.NotNil(t, m, r.stdout)
	digest := m[1]
	require.Equal(t, 30, s.Count(t, "status = 'EXHAUSTED'"))

	// The JSON dry run gives the same digest.
	r = db(t, s, append([]string{"--json", "redrive", "--dry-run"}, filter...)...)
	requireCode(t, r, 0)
	var dry struct {
		Plan struct {
			Digest   string `json:"digest"`
			Matching int64  `json:"matching"`
		} `json:"plan"`
	}
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &dry))
	require.Equal(t, digest, dry.Plan.Digest)
	require.EqualValues(t, 25, dry.Plan.Matching)

	// Executing needs a ticket.
	r = db(t, s, append([]string{"redrive"}, filter...)...)
	requireCode(t, r, 2)
	require.Contains(t, r.stderr, "code: JOURNAL_TICKET_REQUIRED")

	// A digest the flags do not produce is refused before anything runs.
	r = db(t, s, append([]string{"redrive", "--ticket", "CHG-1", "--expect-digest", "deadbeef"}, filter...)...)
	requireCode(t, r, 3)
	require.Contains(t, r.stderr, "code: OUTBOXCTL_DIGEST_MISMATCH")
	require.Equal(t, 30, s.Count(t, "status = 'EXHAUSTED'"))

	// Execution: approved first, then plan, progress per batch on stderr.
	approve(t, s, "redrive", "CHG-1", digest, filter...)
	r = db(t, s, append([]string{"redrive", "--ticket", "CHG-1", "--expect-digest", digest, "--batch-size", "10"}, filter...)...)
	requireCode(t, r, 0)
	require.Regexp(t, `(?m)^digest\s+`+digest+`$`, r.stdout)
	require.Contains(t, r.stdout, "redrive complete under ticket CHG-1: 25 of 25 items (3 batches in this run)")
	require.Contains(t, r.stderr, "redrive CHG-1: batch 1 committed, 10 of 25 items")
	require.Contains(t, r.stderr, "redrive CHG-1: batch 3 committed, 25 of 25 items")
	require.Equal(t, 25, s.Count(t, "status = 'PENDING' AND attempts = 0 AND parked_at IS NULL AND message_id LIKE 'ex-%'"))
	require.Equal(t, 5, s.Count(t, "status = 'EXHAUSTED'"))

	// The same approval never runs twice: park a matching row again and retry.
	exec1(t, s.DB, `UPDATE messaging_outbox SET status = 'EXHAUSTED', parked_at = now() WHERE message_id = 'ex-1'`)
	r = db(t, s, append([]string{"redrive", "--ticket", "CHG-1", "--expect-digest", digest}, filter...)...)
	requireCode(t, r, 3)
	require.Contains(t, r.stderr, "code: JOURNAL_ALREADY_EXECUTED")
	require.Equal(t, 1, s.Count(t, "message_id = 'ex-1' AND status = 'EXHAUSTED'"))

	// Nor can the ticket run a different plan, even one approved itself.
	r = db(t, s, "--json", "redrive", "--dry-run", "--status", "failed")
	requireCode(t, r, 0)
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &dry))
	r = db(t, s, "--json", "redrive", "--ticket", "CHG-1", "--status", "failed", "--expect-digest", dry.Plan.Digest)
	requireCode(t, r, 3)
	var e map[string]any
	require.NoError(t, json.Unmarshal([]byte(r.stderr), &e), r.stderr)
	require.Equal(t, "JOURNAL_PLAN_MISMATCH", e["code"])
	require.Equal(t, 2, s.Count(t, "status = 'FAILED'"))
}

func TestPurgeDeletesOnlyParkedMatchingRows(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	seedParked(t, s)

	ids := []string{"--message-id", "fa-1", "--message-id", "ex-30", "--message-id", "pending-1"}
	digest := dryRunDigest(t, s, "purge", ids...)
	approve(t, s, "purge", "CHG-9", digest, ids...)
	r := db(t, s, append([]string{"--json", "purge", "--ticket", "CHG-9", "--expect-digest", digest}, ids...)...)
	requireCode(t, r, 0)
	var out struct {
		Items   int64 `json:"items"`
		Batches int   `json:"batches"`
		Plan    struct {
			Matching int64 `json:"matching"`
		} `json:"plan"`
	}
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &out), r.stdout)
	require.EqualValues(t, 2, out.Plan.Matching) // pending-1 is not parked
	require.EqualValues(t, 2, out.Items)
	require.Equal(t, 0, s.Count(t, "message_id IN ('fa-1', 'ex-30')"))
	require.Equal(t, 1, s.Count(t, "message_id = 'pending-1'"))
	require.Contains(t, r.stderr, "purge CHG-9: batch 1 committed, 2 of 2 items")

	requireCode(t, db(t, s, append([]string{"purge", "--ticket", "CHG-9", "--expect-digest", digest}, ids...)...), 3)

	// Bad filters are usage errors, and change nothing.
	r = db(t, s, "purge", "--ticket", "CHG-10", "--status", "pending")
	requireCode(t, r, 2)
	require.Contains(t, r.stderr, "code: JOURNAL_INVALID_FILTER")
	r = db(t, s, "purge", "--dry-run", "--since", "yesterday")
	requireCode(t, r, 2)
	require.Contains(t, r.stderr, "RFC 3339")
	requireCode(t, db(t, s, "purge", "--dry-run", "--since", "2030-01-02T00:00:00Z", "--until", "2030-01-01T00:00:00Z"), 2)
	requireCode(t, db(t, s, "purge", "--ticket", "x", "--batch-size", "-1"), 2)

	// A time range selects by created_at.
	r = db(t, s, "purge", "--dry-run", "--since", "2000-01-01T00:00:00Z", "--until", "2100-01-01T00:00:00Z")
	requireCode(t, r, 0)
	require.Regexp(t, `(?m)^matching\s+30$`, r.stdout)
	require.Equal(t, 31, s.Count(t, ""))
}

// dryRunDigest runs `op --dry-run --json` with filter and returns the plan
// digest it prints.
// approve records the approval of op with filter under ticket (the dry
// run's digest), as the test's database login.
func approve(t *testing.T, s *testdb.Schema, op, ticket, digest string, filter ...string) {
	t.Helper()
	r := db(t, s, append([]string{op, "--ticket", ticket, "--expect-digest", digest, "--approve"}, filter...)...)
	requireCode(t, r, 0)
	require.Contains(t, r.stdout, "approved: at most")
}

func dryRunDigest(t *testing.T, s *testdb.Schema, op string, filter ...string) string {
	t.Helper()
	r := db(t, s, append([]string{"--json", op, "--dry-run"}, filter...)...)
	requireCode(t, r, 0)
	var dry struct {
		Plan struct {
			Digest string `json:"digest"`
		} `json:"plan"`
	}
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &dry), r.stdout)
	require.NotEmpty(t, dry.Plan.Digest)
	return dry.Plan.Digest
}

// Issue 21: `purge --ticket made-up-anything` deleted every parked row, and
// a dry run's digest that counted 3 later purged 103. An execution needs an
// approval recorded in the database (the approver is the database login),
// and touches only the rows that approval saw.
func TestPurgeNeedsARecordedApprovalBoundToItsRows(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	insertExhausted(t, s, "a-", 3, "now() - interval '1 hour'")
	digest := dryRunDigest(t, s, "purge", "--status", "exhausted")

	r := db(t, s, "purge", "--status", "exhausted", "--ticket", "made-up-anything", "--expect-digest", digest)
	requireCode(t, r, ExitRefused)
	require.Contains(t, r.stderr, "code: JOURNAL_NOT_APPROVED")
	require.Equal(t, 3, s.Count(t, ""))

	r = db(t, s, "--json", "purge", "--status", "exhausted", "--ticket", "CHG-7", "--expect-digest", digest, "--approve")
	requireCode(t, r, 0)
	var ap map[string]any
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &ap), r.stdout)
	var login string
	require.NoError(t, s.DB.QueryRow(`SELECT session_user`).Scan(&login))
	require.Equal(t, login, ap["approved_by"])
	require.EqualValues(t, 3, ap["approved_count"])
	r = db(t, s, "purge", "--status", "exhausted", "--ticket", "CHG-7", "--expect-digest", digest, "--approve")
	requireCode(t, r, ExitRefused)
	require.Contains(t, r.stderr, "code: JOURNAL_ALREADY_APPROVED")

	// 100 more rows parked after the approval: the same digest purges 3.
	insertExhausted(t, s, "b-", 100, "now() + interval '1 second'")
	r = db(t, s, "purge", "--status", "exhausted", "--ticket", "CHG-7", "--expect-digest", digest)
	requireCode(t, r, 0)
	require.Contains(t, r.stdout, "purge complete under ticket CHG-7: 3 of 3 items")
	require.Zero(t, s.Count(t, "message_id LIKE 'a-%'"))
	require.Equal(t, 100, s.Count(t, "message_id LIKE 'b-%'"))
	require.Equal(t, []string{login}, journalExecutors(t, s, "CHG-7"), "the journal records the login that executed")

	r = db(t, s, "purge", "--dry-run", "--force-takeover")
	requireCode(t, r, ExitUsage)
}

func journalExecutors(t *testing.T, s *testdb.Schema, ticket string) []string {
	t.Helper()
	var raw string
	require.NoError(t, s.DB.QueryRow(`SELECT array_to_json(executed_by)::text FROM messaging_admin_operation WHERE approval_ticket = $1`, ticket).Scan(&raw))
	var out []string
	require.NoError(t, json.Unmarshal([]byte(raw), &out))
	return out
}
