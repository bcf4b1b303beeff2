package main

import (
	"bytes"
	"context"
	"encoding/json"
	"regexp"
	"strconv"
	"strings"
	"sync"
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

// cutWriter collects a command's stderr and cancels the command's context
// when a line containing at appears: the progress line is written after its
// batch committed and before the next one begins, so the cut falls exactly
// between two batches.
type cutWriter struct {
	mu     sync.Mutex
	buf    bytes.Buffer
	at     string
	cancel context.CancelFunc
}

func (w *cutWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf.Write(p)
	if w.at != "" && strings.Contains(w.buf.String(), w.at) {
		w.cancel()
	}
	return len(p), nil
}

func (w *cutWriter) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.buf.String()
}

// runCut runs outboxctl in this process with args, cut at the stderr line
// containing at.
func runCut(t *testing.T, at string, args ...string) (int, string, string) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var stdout bytes.Buffer
	stderr := &cutWriter{at: at, cancel: cancel}
	code := run(ctx, args, &stdout, stderr, func(string) string { return "" })
	return code, stdout.String(), stderr.String()
}

var resumeRe = regexp.MustCompile(`resume it from there with: (outboxctl [^\n]+)`)

// An execution is not cut by --timeout; one cut anyway (here: its context,
// as SIGINT does) says what it did and how to resume; the same operator
// resumes at once without --owner; another owner is told who holds it,
// until when, and the command that resumes it; the printed command finishes
// it, exactly once.
func TestJournalExecutionCutIsResumable(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	seedParked(t, s)
	filter := []string{"--status", "exhausted", "--batch-size", "5"}
	digest := dryRunDigest(t, s, "redrive", "--status", "exhausted")
	approve(t, s, "redrive", "CHG-CUT", digest, "--status", "exhausted")

	// Cut after the second batch (10 of 30 rows).
	args := append([]string{"--database-url", s.URL, "redrive", "--ticket", "CHG-CUT", "--expect-digest", digest}, filter...)
	code, _, stderr := runCut(t, "batch 2 committed", args...)
	require.Equal(t, ExitFailed, code, stderr)
	require.Contains(t, stderr, "code: OUTBOXCTL_OPERATION_INTERRUPTED")
	require.Contains(t, stderr, "redrive under ticket CHG-CUT stopped after 10 items")
	m := resumeRe.FindStringSubmatch(stderr)
	require.NotNil(t, m, stderr)
	require.Contains(t, m[1], "--ticket CHG-CUT --expect-digest "+digest+" --owner outboxctl:")
	require.Equal(t, 10, s.Count(t, "status = 'PENDING' AND message_id LIKE 'ex-%'"))

	// The same operator, same command, no --owner: resumes at once (the
	// lease of the cut run is still live), and is cut again at 20; with
	// --json the error carries the resume command.
	code, _, stderr = runCut(t, "20 of 30 items", append([]string{"--json"}, args...)...)
	require.Equal(t, ExitFailed, code, stderr)
	require.Contains(t, stderr, "stopped after 20 items")
	var jerr map[string]any
	require.NoError(t, json.Unmarshal([]byte(stderr[strings.Index(stderr, "{"):]), &jerr), stderr)
	require.Equal(t, "OUTBOXCTL_OPERATION_INTERRUPTED", jerr["code"])
	require.Equal(t, m[1], jerr["resume"])

	// Another owner is refused while the lease lives, and told how to go on.
	r := db(t, s, append([]string{"redrive", "--ticket", "CHG-CUT", "--expect-digest", digest, "--owner", "someone-else"}, filter...)...)
	requireCode(t, r, ExitRefused)
	require.Contains(t, r.stderr, "code: JOURNAL_IN_FLIGHT")
	require.Regexp(t, `owner outboxctl:\S+ \(database login \S+\) holds ticket CHG-CUT \(20 items done\) until \S+Z`, r.stderr)
	require.Contains(t, r.stderr, "run this command again after ")
	require.Contains(t, r.stderr, "resumes it now as that owner with: outboxctl redrive --status exhausted --batch-size 5 --ticket CHG-CUT --expect-digest "+digest+" --owner outboxctl:")

	// The printed resume command, as printed (plus the database URL),
	// finishes the ticket: 30 rows redriven in all, none twice.
	fields := strings.Fields(jerr["resume"].(string))
	require.Equal(t, "outboxctl", fields[0])
	r = db(t, s, fields[1:]...)
	requireCode(t, r, 0)
	require.Contains(t, r.stdout, "redrive complete under ticket CHG-CUT: 30 of 30 items")
	require.Equal(t, 30, s.Count(t, "status = 'PENDING' AND attempts = 0 AND message_id LIKE 'ex-%'"))
	requireCode(t, db(t, s, fields[1:]...), ExitRefused) // JOURNAL_ALREADY_EXECUTED
}

// The generic --timeout bounds reads, not a journaled execution.
func TestJournalExecutionNotCutByTimeout(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	seedParked(t, s)
	digest := dryRunDigest(t, s, "purge", "--status", "exhausted")
	approve(t, s, "purge", "CHG-T", digest, "--status", "exhausted")
	r := db(t, s, "--timeout", "1ms", "purge", "--status", "exhausted", "--batch-size", "1", "--ticket", "CHG-T", "--expect-digest", digest)
	requireCode(t, r, 0)
	require.Contains(t, r.stdout, "purge complete under ticket CHG-T: 30 of 30 items (30 batches in this run)", "it ends at the approved count, without an empty batch")
	require.Equal(t, 0, s.Count(t, "status = 'EXHAUSTED'"))
	// A dry run still honours it.
	r = db(t, s, "--timeout", "1ns", "purge", "--dry-run")
	require.NotEqual(t, 0, r.code, r.stdout)
}

// Execution needs the approved digest: without it, exit 2 pointing at the
// dry run; with another plan's, exit 3 naming the digest the flags describe.
// A zero-match execution says it consumed the ticket.
func TestJournalExecutionNeedsApprovedDigest(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	seedParked(t, s)
	r := db(t, s, "redrive", "--status", "failed", "--ticket", "CHG-A")
	requireCode(t, r, ExitUsage)
	require.Contains(t, r.stderr, "code: OUTBOXCTL_DIGEST_REQUIRED")
	require.Contains(t, r.stderr, "--dry-run")
	require.Equal(t, 2, s.Count(t, "status = 'FAILED'"))

	failed := dryRunDigest(t, s, "redrive", "--status", "failed")
	exhausted := dryRunDigest(t, s, "redrive", "--status", "exhausted")
	r = db(t, s, "redrive", "--status", "failed", "--ticket", "CHG-A", "--expect-digest", exhausted)
	requireCode(t, r, ExitRefused)
	require.Contains(t, r.stderr, "code: OUTBOXCTL_DIGEST_MISMATCH")
	require.Contains(t, r.stderr, "the flags describe plan "+failed+", not the approved "+exhausted)
	require.Equal(t, 2, s.Count(t, "status = 'FAILED'"))

	// The dry run prints the command to execute once approved.
	r = db(t, s, "redrive", "--dry-run", "--status", "failed")
	requireCode(t, r, 0)
	require.Contains(t, r.stdout, "outboxctl redrive --status failed --ticket <ticket> --expect-digest "+failed+"\n")

	// Zero matches: the ticket is consumed, and says so.
	none := dryRunDigest(t, s, "purge", "--tenant", "nobody")
	approve(t, s, "purge", "CHG-0", none, "--tenant", "nobody")
	r = db(t, s, "purge", "--tenant", "nobody", "--ticket", "CHG-0", "--expect-digest", none)
	requireCode(t, r, 0)
	require.Contains(t, r.stdout, "purge matched no rows: ticket CHG-0 is consumed (recorded COMPLETED with 0 items)")
	r = db(t, s, "--json", "purge", "--tenant", "nobody", "--ticket", "CHG-0", "--expect-digest", none)
	requireCode(t, r, ExitRefused)
	var e map[string]any
	require.NoError(t, json.Unmarshal([]byte(r.stderr), &e))
	require.Equal(t, "JOURNAL_ALREADY_EXECUTED", e["code"])
}

// A run killed with SIGKILL (no report, its lease still live) is resumed by
// the same command at once: the default owner is the same for the same
// operator and ticket. Every row is redriven once.
func TestJournalResumesAfterKill9(t *testing.T) {
	t.Parallel()
	s := newSchema(t)
	insertExhausted(t, s, "k-", 1000, "now()")
	digest := dryRunDigest(t, s, "redrive", "--status", "exhausted")
	approve(t, s, "redrive", "CHG-KILL", digest, "--status", "exhausted")
	args := []string{"--database-url", s.URL, "redrive", "--status", "exhausted", "--batch-size", "1", "--ticket", "CHG-KILL", "--expect-digest", digest}

	p := startRelayProc(t, nil, args...) // any long-running outboxctl with its stderr read line by line
	p.waitLine(t, func(l string) bool { return strings.Contains(l, "batch 1 committed") })
	require.NoError(t, p.cmd.Process.Kill())
	_ = p.cmd.Wait()
	<-p.errEnd
	require.NotContains(t, p.log.String(), "complete under ticket", "the run finished before the kill; the test needs more rows")
	done := s.Count(t, "status = 'PENDING'")
	require.Less(t, done, 1000)

	r := db(t, s, args[2:]...)
	requireCode(t, r, 0)
	require.Contains(t, r.stdout, "redrive complete under ticket CHG-KILL: 1000 of 1000 items")
	require.Equal(t, 1000, s.Count(t, "status = 'PENDING' AND attempts = 0"))
}
