package main

import (
	"bytes"
	"context"
	"encoding/json"
	"regexp"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

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
